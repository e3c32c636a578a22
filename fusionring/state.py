"""Process-wide state: the global runtime (init, shutdown, get) and where operations go.

Above the runtime: it starts one (`init`), stops it (`shutdown`, also at interpreter exit)
and routes operations to it or to a process set's runtime (`using`, `current`, `get`).
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import sys
from typing import Callable, List, Optional

from .exceptions import NotInitializedError
from . import launch_checks, process_exit
from .runtime import Runtime, close_shared_memory

_runtime: Optional[Runtime] = None  # the global runtime, after init()
_atexit_registered = False
# Called by shutdown() before the global runtime stops (process sets register theirs here,
# so that this module need not know about them).
_shutdown_hooks: List[Callable[[], None]] = []


def _in_this_process(hook: Callable[[], None]) -> Callable[[], None]:
    """`hook` for atexit, doing nothing in a child forked from this process (os.fork() after
    init()): there it would shut down, or free the windows of, the parent's runtime, and
    hang in MPI the child never joined."""
    pid = os.getpid()

    def run() -> None:
        if os.getpid() == pid:
            hook()
    return run


def init(comm=None) -> Runtime:
    """Start the runtime (idempotent). `comm` is an mpi4py communicator; default COMM_WORLD."""
    global _runtime, _atexit_registered
    if _runtime is not None and _runtime.alive:
        return _runtime
    if "mpi4py.MPI" not in sys.modules:  # once MPI is up, this process is a rank
        launch_checks.not_a_worker_process("init()")
        launch_checks.launcher_reachable("init()")
    # A parameter-server worker (fusionring.ps sits above the runtime, so it is looked up, not
    # imported: loaded only if the script started a parameter-server job).
    ps_worker = sys.modules.get("fusionring.ps.worker")
    blocked = ps_worker.init_would_wait(comm) if ps_worker is not None else None
    if blocked:
        raise RuntimeError(blocked)
    from mpi4py import MPI

    if isinstance(comm, (list, tuple)):
        ranks = [int(r) for r in comm]
        if MPI.COMM_WORLD.Get_rank() not in ranks:
            raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()} is not among the ranks {ranks} "
                             f"passed to init()")
        # Only the listed ranks take part (MPI_Comm_create_group, as Horovod): the others
        # need not call init() at all.
        comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(ranks))
    elif comm is None and MPI.COMM_WORLD.Get_size() == 1:
        launch_checks.not_a_lone_copy(MPI)
    _runtime = Runtime(comm)
    process_exit.recovered()   # every rank of the new runtime is back: end as usual
    process_exit.record_process(MPI.COMM_WORLD.Get_rank())
    if not _atexit_registered:
        # Run last first: shutdown, then the windows are freed, then mpi4py's MPI_Finalize.
        atexit.register(_in_this_process(close_shared_memory))
        atexit.register(_in_this_process(shutdown))
        _atexit_registered = True
        process_exit.exit_on_uncaught(shutdown)
    return _runtime


def shutdown() -> None:
    """Stop the runtime on this rank; ranks still running see their pending ops fail."""
    global _runtime
    for hook in list(_shutdown_hooks):
        hook()
    if _runtime is not None:
        runtime, _runtime = _runtime, None
        runtime.shutdown()


# The runtime of the process set an operation was called with (see fusionring.process_sets);
# unset, operations run on the global runtime.
_current: "contextvars.ContextVar[Optional[Runtime]]" = contextvars.ContextVar(
    "fusionring_runtime", default=None)


@contextlib.contextmanager
def using(runtime: Optional[Runtime]):
    """Route operations started inside the block to `runtime` (None: the global one)."""
    token = _current.set(runtime)
    try:
        yield runtime
    finally:
        _current.reset(token)


_burst: "contextvars.ContextVar[bool]" = contextvars.ContextVar("fusionring_burst", default=False)


class burst:
    """Operations started inside the block go to `runtime` (as using() does) and belong to a
    burst (a backward pass's gradients): the runtime may gather them until the burst ends,
    a caller waits on one, or a few cycle times pass, and negotiate them in one round
    instead of starting a round for each. A class, not a generator: it wraps every
    gradient's submission."""

    __slots__ = ("_runtime", "_tokens")

    def __init__(self, runtime: Optional[Runtime] = None) -> None:
        self._runtime = runtime

    def __enter__(self) -> None:
        self._tokens = (_current.set(self._runtime), _burst.set(True))

    def __exit__(self, *exc) -> None:
        _burst.reset(self._tokens[1])
        _current.reset(self._tokens[0])


def in_burst() -> bool:
    """Whether operations started here belong to a burst (see burst())."""
    return _burst.get()


def current() -> Optional[Runtime]:
    """The process set's runtime operations are routed to here, or None (global)."""
    return _current.get()


def routed() -> Optional[Runtime]:
    """The runtime operations started here go to (a process set's, or the global one), or
    None before init()."""
    return _current.get() or _runtime


def get(what: str = "this operation") -> Runtime:
    """The live runtime, or NotInitializedError naming what was attempted."""
    routed = _current.get()
    if routed is not None:
        return routed
    if _runtime is None:
        raise NotInitializedError(what)
    return _runtime


def is_initialized() -> bool:
    """Whether init() has run (and shutdown() has not) on this rank."""
    return _runtime is not None


def global_runtime(what: str = "this operation") -> Runtime:
    """The global runtime, whatever process set operations are routed to here."""
    if _runtime is None:
        raise NotInitializedError(what)
    return _runtime


def on_shutdown(hook: Callable[[], None]) -> None:
    """Run `hook` at the start of every shutdown(), before the global runtime stops."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)
