"""Reduction operations and the one place that turns Average into scale factors."""
from __future__ import annotations

import enum
import warnings
from typing import Tuple


class ReduceOp(enum.IntEnum):
    """User-facing reduction ops (Horovod's names and values)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


# Codes of the C++ core's ReduceOp enum; Adasum is combined in the runtime, not the core.
_CORE_CODE = {ReduceOp.Sum: 0, ReduceOp.Min: 1, ReduceOp.Max: 2, ReduceOp.Product: 3}
ADASUM_CODE = -1


def resolve_op(op, average=None) -> ReduceOp:
    """Horovod's rule: ``op`` wins; the deprecated ``average`` flag maps to Average/Sum."""
    if average is None and isinstance(op, ReduceOp):  # the common case, on every gradient
        return op
    if op is not None and average is not None:
        raise ValueError("pass either op or the deprecated average argument, not both")
    if op is None:
        if average is None:
            return ReduceOp.Average
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return ReduceOp.Average if average else ReduceOp.Sum
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        raise ValueError(f"unsupported reduction op {op!r}; use Average, Sum, Adasum, Min, Max "
                         f"or Product") from None


def core_reduction(op: ReduceOp, prescale: float, postscale: float,
                   world_size: int) -> Tuple[int, float, float]:
    """Map (op, prescale, postscale) to the core's (op code, prescale, postscale).

    Average is Sum with the result divided by the world size; this is the only place
    that divides, so every path (functions, optimizer, compressors) agrees.
    """
    if op == ReduceOp.Average:
        return _CORE_CODE[ReduceOp.Sum], float(prescale), float(postscale) / world_size
    if op == ReduceOp.Adasum:
        return ADASUM_CODE, float(prescale), float(postscale)
    return _CORE_CODE[op], float(prescale), float(postscale)
