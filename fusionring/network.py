"""This host's network interfaces (psutil): an interface's IPv4 address and bytes sent.

Both read the network namespace the process runs in, as the emulated cluster's ranks need.
"""
from __future__ import annotations

import socket
from typing import Optional

import psutil


def interface_address(name: str) -> Optional[str]:
    """The IPv4 address of network interface `name`, or None when it has none (or is absent)."""
    for address in psutil.net_if_addrs().get(name, ()):
        if address.family == socket.AF_INET:
            return address.address
    return None


def interface_tx_bytes(name: str) -> Optional[int]:
    """Bytes interface `name` has transmitted, or None when it is absent."""
    counters = psutil.net_io_counters(pernic=True).get(name)
    return None if counters is None else counters.bytes_sent
