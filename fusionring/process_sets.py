"""Process sets: operations on a subset of the ranks.

``global_process_set`` is every rank of the communicator given to ``init()``. Another set
(``ProcessSet([0, 2])``) is registered collectively, by every rank, with ``init(process_sets=
[...])`` or ``add_process_set``; its members then get a runtime of their own on a
sub-communicator (its own negotiation, fusion and background thread), so operations on
different sets proceed independently. Ranks are always given as global ranks, root ranks
of broadcasts included; ``Average`` divides by the set's size.
"""
from __future__ import annotations

import numbers
import threading
from typing import Dict, List, Optional, Sequence, Union

from . import state as _state
from .runtime import Runtime


class ProcessSet:
    """A set of global ranks; ``ProcessSet(None)`` (``global_process_set``) is every rank.

    Made from a list of ranks or from an mpi4py communicator (``ProcessSet(subcomm)``: its
    ranks, translated to the global communicator's; it may be made before ``init()``, and
    may differ from rank to rank, as ``Split`` makes it). A set other than the global one
    can be used once registered (``add_process_set`` or ``init(process_sets=...)``), and
    only on its member ranks."""

    def __init__(self, ranks_or_comm: Union[None, Sequence[int], object] = None) -> None:
        self.mpi_comm = None
        # None: every rank, or (with mpi_comm) not yet translated to global ranks
        self._ranks: Optional[List[int]] = None
        self.process_set_id: Optional[int] = 0 if ranks_or_comm is None else None
        self._runtime: Optional[Runtime] = None
        self._comm = None  # the sub-communicator, on members
        if ranks_or_comm is not None and hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            if _state.is_initialized():
                self._resolve()
        elif ranks_or_comm is not None:
            self._ranks = _checked(ranks_or_comm)

    def _resolve(self) -> None:
        """Translate a communicator's ranks to global ranks (needs the runtime)."""
        if self._ranks is None and self.mpi_comm is not None and self.process_set_id != 0:
            self._ranks = _checked(_ranks_of_comm(self.mpi_comm))

    def _is_global(self) -> bool:
        self._resolve()
        return self._ranks is None

    @property
    def ranks(self) -> List[int]:
        """The member ranks, as global ranks (all ranks for the global set)."""
        if self._is_global():
            return list(range(_state.get("ProcessSet.ranks").size))
        return list(self._ranks)

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not added (as in Horovod)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set; a ValueError when it is not a member, and None
        while the set is not added, as in Horovod."""
        if self.process_set_id is None:
            return None
        me = _global_runtime("ProcessSet.rank()").rank
        ranks = self.ranks
        if me not in ranks:
            raise ValueError(f"Process is not part of provided process set: rank {me} is not "
                             f"in the process set with ranks {ranks}")
        return ranks.index(me)

    def included(self) -> bool:
        """Whether this process is a member, added or not (as in Horovod)."""
        return _global_runtime("ProcessSet.included()").rank in self.ranks

    def __repr__(self) -> str:
        if self._ranks is None:
            ranks = self.ranks if (_state.is_initialized() and self.process_set_id == 0) else None
        else:
            ranks = self._ranks
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={ranks}, "
                f"mpi_comm={self.mpi_comm})")


def _checked(ranks: Sequence[int]) -> List[int]:
    try:
        ranks = list(ranks)
    except TypeError:
        raise ValueError(f"ProcessSet should be made from a list of process ranks or an mpi4py "
                         f"communicator, not {type(ranks).__name__}") from None
    # bool is an int to Python, but never meant as a rank; 1.5 or "1" would be silently cut.
    if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in ranks):
        raise ValueError(f"ProcessSet should be made from a list of process ranks (integers) or "
                         f"an mpi4py communicator, got {ranks!r}")
    ranks = [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"a process set needs distinct ranks, got {ranks}")
    return sorted(ranks)


global_process_set = ProcessSet(None)

_lock = threading.Lock()
_registered: Dict[int, ProcessSet] = {}
_next_id = 1


def _global_runtime(what: str) -> Runtime:
    return _state.global_runtime(what)


def _ranks_of_comm(comm) -> List[int]:
    from mpi4py import MPI

    world = _global_runtime("ProcessSet(comm)").base_comm
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          world.Get_group()))


def runtime_for(process_set, what: str) -> Optional[Runtime]:
    """The runtime that runs `what` for `process_set`; None means the global runtime.

    Raises ValueError for a set that is not registered, or when this rank is not in it.
    """
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, not "
                        f"{type(process_set).__name__}")
    if process_set._is_global():
        return None
    if process_set.process_set_id is None or process_set.process_set_id not in _registered:
        raise ValueError(f"{what}: process set with ranks {process_set.ranks} has not been "
                         f"added; call hvd.add_process_set() on every rank first")
    if process_set._runtime is None:
        me = _global_runtime(what).rank
        raise ValueError(f"{what}: rank {me} is not in the process set with ranks "
                         f"{process_set.ranks}")
    return process_set._runtime


def is_added(process_set) -> bool:
    """Whether `process_set` is the global set or a set registered on this rank."""
    if not isinstance(process_set, ProcessSet):
        return False
    return process_set._is_global() or process_set.process_set_id in _registered


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set: a collective, called by every rank with the same ranks.

    Members get their own runtime on a sub-communicator. Returns the registered set.
    """
    global _next_id
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set._is_global():
        return global_process_set
    runtime = _global_runtime("add_process_set()")
    ranks = process_set.ranks
    if ranks[-1] >= runtime.size or ranks[0] < 0:
        raise ValueError(f"add_process_set(): ranks {ranks} are out of range for "
                         f"{runtime.size} ranks")
    if process_set.process_set_id is not None and process_set.process_set_id in _registered:
        raise ValueError(f"add_process_set(): {process_set!r} is already added")
    # As Horovod: no two sets of the same ranks (every rank: the global set). Registration is
    # collective, so every rank finds the same and raises alike.
    with _lock:
        same = next((p for p in _registered.values() if p.ranks == ranks), None)
    if same is None and ranks == list(range(runtime.size)):
        same = global_process_set
    if same is not None:
        raise ValueError(f"Attempted to add a duplicate process set: ranks {ranks} are already "
                         f"process set {same.process_set_id}")
    # Every rank must ask for the same set, in the same order, or communicators mismatch.
    # An agreement on the communicator the runtime was made from (it creates the
    # sub-communicator below, a collective on it anyway), not through the runtime's queue.
    asked = runtime.base_comm.allgather(ranks)
    if any(a != ranks for a in asked):
        differing = ", ".join(f"rank {r} asked for {a}" for r, a in enumerate(asked))
        raise ValueError(f"add_process_set(): ranks disagree on the set: {differing}")
    base = runtime.base_comm
    group = base.Get_group().Incl(ranks)
    try:
        sub = base.Create(group)
    finally:
        group.Free()
    with _lock:
        process_set.process_set_id = _next_id
        _next_id += 1
        _registered[process_set.process_set_id] = process_set
    if runtime.rank in ranks:
        process_set._comm = sub
        process_set._runtime = Runtime(sub, global_ranks=ranks, timeline_owner=runtime)
    return process_set


def register_at_init(process_sets: Sequence[Union[ProcessSet, Sequence[int], object]]) -> None:
    """``init(process_sets=[...])``: register the sets every rank named, on every rank.

    A rank may name sets the others do not (``ProcessSet(subcomm)`` after ``Split`` is its
    own half on each rank): the sets of all ranks are gathered and registered in the order
    rank 0's come first, then rank 1's new ones, and so on. A set of every rank is the
    global set (id 0); a set named twice, or already registered by an earlier ``init()``,
    is registered once. Each object passed in ends up as the registered set of its ranks.
    """
    runtime = _global_runtime("init(process_sets=...)")
    mine = [p if isinstance(p, ProcessSet) else ProcessSet(p) for p in process_sets]
    everyone = list(range(runtime.size))
    named = runtime.base_comm.allgather([p.ranks for p in mine])
    known = {tuple(p.ranks): p for p in list(_registered.values())}
    for ranks in (ranks for rank_lists in named for ranks in rank_lists):
        if ranks == everyone or tuple(ranks) in known:
            continue
        own = next((p for p in mine if p.ranks == ranks and p.process_set_id is None), None)
        known[tuple(ranks)] = add_process_set(own if own is not None else ProcessSet(ranks))
    for p in mine:
        if p.ranks == everyone:
            p._ranks, p.process_set_id = None, 0  # the global set, as in Horovod
        elif p.process_set_id is None:  # named twice: the same registered set
            same = known[tuple(p.ranks)]
            p.process_set_id, p._runtime, p._comm = same.process_set_id, same._runtime, same._comm


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered set with this id (0: the global set)."""
    if process_set_id == 0:
        return global_process_set
    with _lock:
        found = _registered.get(process_set_id)
    if found is None:
        raise ValueError(f"No known process set with id {process_set_id}")
    return found


def process_sets() -> List[ProcessSet]:
    """Every registered set by id, the global set first."""
    with _lock:
        return [global_process_set] + [_registered[i] for i in sorted(_registered)]


def _release(process_set: ProcessSet, reason: Optional[str] = None,
             together: bool = False) -> None:
    """Stop the set's runtime here; `together`: every member does so now (a removal), so its
    shared memory can be freed at once rather than at exit."""
    if process_set._runtime is not None:
        process_set._runtime.shutdown(reason=reason)
        if together:
            process_set._runtime.free_shared_memory()
        process_set._runtime = None
    if process_set._comm is not None:
        try:
            process_set._comm.Free()
        except Exception:  # noqa: BLE001 - MPI may already be finalized at exit
            pass
        process_set._comm = None


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added before (a collective on every rank); False for the global set."""
    if not isinstance(process_set, ProcessSet) or process_set._is_global():
        return False
    with _lock:
        known = _registered.pop(process_set.process_set_id, None) is not None
    if not known:
        return False
    runtime = _global_runtime("remove_process_set()")
    _release(process_set, f"process set {process_set.ranks} was removed (remove_process_set) "
                          f"while this operation on it was pending", together=True)
    runtime.base_comm.Barrier()  # every rank has let go of the set before any adds another
    process_set.process_set_id = None
    return True


def shutdown_all() -> None:
    """Stop every process set's runtime on this rank (part of ``shutdown()``); a later
    ``init()`` numbers its sets from 1 again."""
    global _next_id
    with _lock:
        sets = list(_registered.values())
        _registered.clear()
        _next_id = 1
    for process_set in sets:
        _release(process_set)
        process_set.process_set_id = None


_state.on_shutdown(shutdown_all)
