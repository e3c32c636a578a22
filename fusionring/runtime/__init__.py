"""The runtime: requests, the background control loop, and the collectives it drives.

- ``loop.py``: Runtime, one per process (and per process set): the queue, the handles, one
  negotiation round per cycle, fused batches and collectives in response order.
- ``requests.py``: Request (one submitted operation) and Stats (the counters).
- ``allreduce.py``: how a fused batch is carried, as an ordered list of ops (a compressor
  that reduces itself, the shared-memory window, the ring).
- ``collectives.py``: allgather, alltoall, reducescatter, broadcast, barrier, Adasum.
- ``topology.py``: hosts and cores, and what follows from them (MPI waits, the window).

Process-wide state (init, shutdown, the global runtime) is one layer up, in
:mod:`fusionring.state`.
"""
from __future__ import annotations

from .loop import Runtime, close_shared_memory
from .requests import Request, Stats

__all__ = ["Runtime", "Request", "Stats", "close_shared_memory"]
