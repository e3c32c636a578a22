"""The parameter server's messages: tags, headers, the shard of each server, and polling with a deadline.

Every message is a small pickled header on a control tag, followed, when it carries tensors, by one raw byte
buffer on a data tag from the same sender. A worker sends all its headers on ``TAG_TO_SERVER`` so the server sees
them in the order they were sent (MPI keeps the order per sender and tag); a server answers on ``TAG_TO_WORKER``.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..config import settings
from ..exceptions import StallError

TAG_TO_SERVER = 7301     # worker -> server headers: hello, push, epoch, bye, save, state, load
TAG_TO_SERVER_DATA = 7302  # worker -> server: a push's encoded gradients
TAG_TO_WORKER = 7303     # server -> worker headers: params, saved, state, error
TAG_TO_WORKER_DATA = 7304  # server -> worker: the parameters

# Header kinds.
HELLO = "hello"    # model description, optimizer class and hyper-parameters, sync settings (+ worker 0's values)
PUSH = "push"      # one step's gradient: iteration, hyper-parameters, encoded layout; data follows
EPOCH = "epoch"    # the worker completed an epoch
BYE = "bye"        # the worker shut down; the server stops waiting for it
PARAMS = "params"  # the server's parameters (its shard) after the updates a push led to; data follows
ERROR = "error"    # the server failed (a dead worker, a mismatched model); the message says why
FAILED = "failed"  # a worker failed before or instead of its hello (a bad argument); the message says why
SAVE = "save"      # worker 0's ps.save(): write this server's state to the file named
SAVED = "saved"    # the server wrote its state
STATE = "state"    # a worker's state_dict(): send this server's state (request and reply); data follows the reply
LOAD = "load"      # load_state_dict(): every worker sends one; worker 0's carries the state (or its file)


@dataclass
class Header:
    """One message's header: its kind and its fields."""
    kind: str
    fields: Dict[str, Any] = field(default_factory=dict)


def timeout_s() -> float:
    """How long to wait on a silent peer before failing (FUSIONRING_STALL_SHUTDOWN_S, else PS_TIMEOUT_S)."""
    s = settings()
    return float(s.stall_shutdown_s) if s.stall_shutdown_s else float(s.ps_timeout_s)


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


_exit_registered = False


def exit_nonzero_without_finalize() -> None:
    """Make this process end with status 1 and without MPI_Finalize, once its error has been printed.

    After a peer died, MPI_Finalize can wait for it forever; a process that saw the job fail must neither hang
    there nor report success. Registered once, on the first fatal error (Python runs it before MPI's own exit
    hook, and after printing an uncaught exception's traceback)."""
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True

    def _exit() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(1)

    atexit.register(_exit)


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
                   other: Sequence[Tuple[str, Tuple[int, ...], str]], worker: int) -> Optional[str]:
    """None when ``other`` (worker ``worker``'s model) matches worker 0's ``reference``, else what differs."""
    ref = {n: (s, d) for n, s, d in reference}
    got = {n: (s, d) for n, s, d in other}
    # in worker 0's order: the first parameter that differs is the one named
    for name in [n for n, _, _ in reference] + [n for n, _, _ in other if n not in ref]:
        if name not in got:
            return f"parameter {name!r} is in worker 0's model but not in worker {worker}'s"
        if name not in ref:
            return f"parameter {name!r} is in worker {worker}'s model but not in worker 0's"
        if ref[name] != got[name]:
            return (f"parameter {name!r} differs: worker 0 has shape {list(ref[name][0])} {ref[name][1]}, "
                    f"worker {worker} has shape {list(got[name][0])} {got[name][1]}")
    if [n for n, _, _ in reference] != [n for n, _, _ in other]:
        return f"parameters are in a different order on worker 0 and worker {worker}"
    return None
