"""Process sets: which ranks an operation runs on.

fusionring runs every operation on all ranks of the communicator given to ``init()``
(``global_process_set``). Horovod's API for subsets is present so scripts that name the
global set run unchanged; asking for a subset fails with a clear error instead of
silently running on every rank.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from . import runtime as _rt


class ProcessSet:
    """A set of ranks; ``ProcessSet(None)`` (``global_process_set``) means every rank."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self._ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None

    @property
    def ranks(self) -> List[int]:
        """The member ranks (all ranks for the global set)."""
        if self._ranks is None:
            return list(range(_rt.get("ProcessSet.ranks").size))
        return list(self._ranks)

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set, or -1 when it is not a member."""
        me = _rt.get("ProcessSet.rank()").rank
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool:
        return self.rank() >= 0

    def is_global(self) -> bool:
        """True when the set holds every rank."""
        return self._ranks is None or self._ranks == list(range(_rt.get("ProcessSet").size))

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self._ranks is None else f"ProcessSet({self._ranks})"


global_process_set = ProcessSet(None)


def check_process_set(process_set, what: str) -> None:
    """Accept None or a set that holds every rank; otherwise raise naming the ranks."""
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, not "
                        f"{type(process_set).__name__}")
    if not process_set.is_global():
        raise NotImplementedError(
            f"{what}: process set with ranks {process_set.ranks} requested, but fusionring runs "
            f"every operation on all {_rt.get(what).size} ranks; call init(comm=[...]) with those "
            f"ranks in a separate job instead")


def add_process_set(process_set) -> ProcessSet:
    """Register a process set. Only a set holding every rank is supported."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    check_process_set(process_set, "add_process_set()")
    return global_process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Horovod's counterpart of add_process_set(); the global set is never removed."""
    check_process_set(process_set, "remove_process_set()")
    return False
