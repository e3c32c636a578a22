"""The parameter server's messages: tags, headers, the shard of each server, and polling with a deadline.

Every message is a small pickled header on a control tag, followed, when it carries tensors, by one raw byte
buffer on a data tag from the same sender. A worker sends all its headers on ``TAG_TO_SERVER`` so the server sees
them in the order they were sent (MPI keeps the order per sender and tag); a server answers on ``TAG_TO_WORKER``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import settings
from ..exceptions import StallError

TAG_TO_SERVER = 7301     # worker -> server headers: hello, push, epoch, bye, save, state, load, heartbeat
TAG_TO_SERVER_DATA = 7302  # worker -> server: a push's encoded gradients
TAG_TO_WORKER = 7303     # server -> worker headers: params, saved, state, error, heartbeat
TAG_TO_WORKER_DATA = 7304  # server -> worker: the parameters

# Header kinds.
HELLO = "hello"    # model (and buffer) description, optimizer class and hyper-parameters, sync settings (+ worker
                   # 0's values)
PUSH = "push"      # one step's gradient: iteration, hyper-parameters, encoded layout, which parameters had no
                   # gradient; data follows (then, from worker 0 to server 0, its buffers)
EPOCH = "epoch"    # the worker completed an epoch
BYE = "bye"        # the worker shut down; the server stops waiting for it
PARAMS = "params"  # the server's parameters (its shard) after the updates a push led to; data follows
ERROR = "error"    # the server failed (a dead worker, a mismatched model); the message says why
FAILED = "failed"  # a worker failed before or instead of its hello (a bad argument); the message says why
SAVE = "save"      # worker 0's ps.save(): write this server's state to the file named
SAVED = "saved"    # the server wrote its state
STATE = "state"    # a worker's state_dict(): send this server's state (request and reply); data follows the reply
LOAD = "load"      # load_state_dict(): every worker sends one; worker 0's carries the state (or its file)
HEARTBEAT = "beat"  # "still alive", every few seconds: a worker's process to each server, a server to each worker
                    # waiting on it; on the header tags, so each is received before anything sent after it


@dataclass
class Header:
    """One message's header: its kind and its fields."""
    kind: str
    fields: Dict[str, Any] = field(default_factory=dict)


def timeout_s() -> Optional[float]:
    """How long to wait on a silent peer before failing (FUSIONRING_STALL_SHUTDOWN_S, else PS_TIMEOUT_S);
    None: no limit."""
    s = settings()
    if s.stall_shutdown_s:
        return float(s.stall_shutdown_s)
    return float(s.ps_timeout_s) if s.ps_timeout_s else None


def longest(*limits: Optional[float]) -> Optional[float]:
    """The longest of some time limits, None (no limit) if any of them is None."""
    return None if any(x is None for x in limits) else max(limits)  # type: ignore[type-var]


def times(factor: float, limit: Optional[float]) -> Optional[float]:
    """``factor * limit``, None when there is no limit."""
    return None if limit is None else factor * limit


def heartbeat_interval(limit: Optional[float]) -> float:
    """How often a live peer says so: several times within the stall limit, and at most every 2 s."""
    return 2.0 if limit is None else min(2.0, max(0.05, limit / 4))


def poll_until(probe: Callable[[], bool], deadline: float, what: Callable[[], str]) -> None:
    """Call ``probe`` until it is true; past ``deadline`` (time.monotonic()) raise StallError saying ``what``.

    Polling with short naps, rather than a blocking receive, is what turns a dead peer into an error."""
    nap = settings().ps_poll_sleep_us / 1e6
    spins = 0
    while not probe():
        if time.monotonic() > deadline:
            raise StallError(what())
        spins += 1
        if spins > 50 and nap > 0:  # spin briefly first: a reply is often already on its way
            time.sleep(nap)



def server_ranks(num_servers: int) -> List[int]:
    """The world ranks that serve: the first ``num_servers``."""
    return list(range(num_servers))


def shard_names(names: Sequence[str], nbytes: Sequence[int], num_servers: int) -> List[List[str]]:
    """Split parameters between servers, balanced by bytes: largest first, each to the least loaded server
    (ties: lower server). Deterministic, so every rank computes the same split."""
    order = sorted(range(len(names)), key=lambda i: (-nbytes[i], i))
    load = [0] * num_servers
    shards: List[List[int]] = [[] for _ in range(num_servers)]
    for i in order:
        s = min(range(num_servers), key=lambda k: (load[k], k))
        shards[s].append(i)
        load[s] += nbytes[i]
    return [[names[i] for i in sorted(shard)] for shard in shards]


def describe_model(named: Sequence[Tuple[str, Any]]) -> List[Tuple[str, Tuple[int, ...], str]]:
    """(name, shape, dtype) per parameter: what every worker's model must agree on."""
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in named]


def model_mismatch(reference: Sequence[Tuple[str, Tuple[int, ...], str]],
                   other: Sequence[Tuple[str, Tuple[int, ...], str]], worker: int,
                   what: str = "parameter") -> Optional[str]:
    """None when ``other`` (worker ``worker``'s model) matches worker 0's ``reference``, else what differs
    (``what``: "parameter" or "buffer")."""
    ref = {n: (s, d) for n, s, d in reference}
    got = {n: (s, d) for n, s, d in other}
    # in worker 0's order: the first one that differs is the one named
    for name in [n for n, _, _ in reference] + [n for n, _, _ in other if n not in ref]:
        if name not in got:
            return f"{what} {name!r} is in worker 0's model but not in worker {worker}'s"
        if name not in ref:
            return f"{what} {name!r} is in worker {worker}'s model but not in worker 0's"
        if ref[name] != got[name]:
            return (f"{what} {name!r} differs: worker 0 has shape {list(ref[name][0])} {ref[name][1]}, "
                    f"worker {worker} has shape {list(got[name][0])} {got[name][1]}")
    if [n for n, _, _ in reference] != [n for n, _, _ in other]:
        return f"{what}s are in a different order on worker 0 and worker {worker}"
    return None


def absent_bitmap(names: Sequence[str], absent: Any) -> Optional[bytes]:
    """Which of ``names`` (a shard, in order) a push has no gradient for, one bit each; None when it has one
    for every parameter (the common case costs nothing)."""
    bits = [n in absent for n in names]
    return np.packbits(np.array(bits, dtype=bool)).tobytes() if any(bits) else None


def absent_names(names: Sequence[str], bitmap: Optional[bytes]) -> frozenset:
    """``absent_bitmap``'s names back from its bits."""
    if not bitmap:
        return frozenset()
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8))[:len(names)]
    return frozenset(names[i] for i in np.flatnonzero(bits))
