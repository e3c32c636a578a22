"""Byte units and how sizes are written (plans, benchmark pages)."""
from __future__ import annotations

from typing import Optional

KIB = 1024
MIB = 1024 * 1024


def format_bytes(nbytes: float, decimals: Optional[int] = None) -> str:
    """Binary units: 4096 -> '4 KiB', 1.25 MiB -> '1.25 MiB' (3 significant digits), or with
    `decimals` a fixed count of them (1536, 2 -> '1.50 KiB')."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.{decimals}f} {unit}" if decimals is not None else f"{value:.3g} {unit}"
    return f"{int(nbytes)} B"
