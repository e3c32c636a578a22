"""Where the ranks run: hosts, cores and the choices that follow from them (how MPI waits,
whether the shared-memory window is used). Every rank decides from the same gathered facts,
so all decide alike."""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import List, Tuple

from ..config import Settings
from ..exceptions import FusionRingError


@dataclasses.dataclass
class HostLayout:
    """This rank's place among the ranks of a communicator and of its host."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    # The cores each rank of this host may run on (its affinity), in local-rank order.
    local_cores: List[List[int]]
    cross_rank: int
    cross_size: int

    @classmethod
    def gather(cls, base, MPI) -> "HostLayout":
        """A collective on `base`: every rank learns its host's ranks and their cores."""
        rank, size = base.Get_rank(), base.Get_size()
        local = base.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            local_rank, local_size = local.Get_rank(), local.Get_size()
            local_cores = local.allgather(sorted(usable_cores()))
        finally:
            local.Free()
        cross = base.Split(color=local_rank, key=rank)
        try:
            cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
        finally:
            cross.Free()
        return cls(rank, size, local_rank, local_size, local_cores, cross_rank, cross_size)

    def host_cores(self) -> int:
        """How many distinct cores the ranks of this host may run on, together."""
        return len(set().union(*map(set, self.local_cores)))

    def oversubscribed(self) -> bool:
        """Whether this host's ranks outnumber the cores they may run on."""
        return self.local_size > self.host_cores()

    def core_share(self) -> float:
        """How many cores this rank has to itself: each core it may run on counts 1/k when k
        ranks of this host may run there (ranks bound to their own cores: all of them)."""
        mine = self.local_cores[self.local_rank]
        return sum(1.0 / sum(core in cores for cores in self.local_cores) for core in mine)


def wait_mode(config: Settings, layout: HostLayout) -> str:
    """ "sleep" or "spin" for this run.

    Measured on the emulated 1 Gbit cluster (4 ranks, 2 cores): sleeping waits took dense
    steps from ~700 to ~620 ms and 2:4 steps from ~430 to ~330 ms; on shared memory they
    made steps slower (wake-ups cost more than the spinning they save).
    """
    mode = config.mpi_wait
    if mode == "auto":
        mode = "sleep" if layout.local_size < layout.size else "spin"
    return mode


# A reply that comes this soon is caught without a nap when waits sleep.
_SPIN_BEFORE_SLEEP_US = 100


def wait_policy(config: Settings, layout: HostLayout) -> Tuple[int, int]:
    """(spin_us, sleep_us) for the core's MPI waits; sleep_us 0 polls nonstop (MPI_Wait).

    An explicit "spin" polls nonstop. "auto" on one host tests for up to mpi_wait_spin_us
    first, yielding the core between tests, and then naps: a wait that lasts longer than that
    is a late peer, not a reply in flight, and polling through it took a core per blocked rank
    (99 % measured for a rank waiting in an allreduce for a peer 5 s late; an idle runtime
    took 12 %).
    """
    mode = wait_mode(config, layout)
    if mode == "sleep":
        return _SPIN_BEFORE_SLEEP_US, config.mpi_wait_sleep_us
    if config.mpi_wait == "spin":
        return 0, 0
    return config.mpi_wait_spin_us, config.mpi_wait_sleep_us


def wants_shared_memory(config: Settings, layout: HostLayout) -> bool:
    """Whether to map the shared-memory window: when configured and every rank shares this host
    (with more ranks than cores too: its waits sleep on a futex after a short spin, which
    hands the core to a peer still computing, where a polled MPI wait holds on to it)."""
    mode = config.shared_memory
    if mode == "off" or layout.size == 1:
        return False
    one_host = layout.local_size == layout.size
    if mode == "on" and not one_host:
        raise FusionRingError("FUSIONRING_SHARED_MEMORY=on needs every rank on one host")
    return one_host


_THREAD_LEVELS = ("MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED",
                  "MPI_THREAD_MULTIPLE")


def warn_unless_thread_multiple(MPI) -> None:
    """fusionring calls MPI from its background thread while the caller's thread may call it
    too (process sets, the user's own mpi4py calls): anything below MPI_THREAD_MULTIPLE can
    corrupt MPI's state, so say so once, with the fix."""
    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_MULTIPLE:
        return
    level = (_THREAD_LEVELS[provided] if 0 <= provided < len(_THREAD_LEVELS)
             else f"thread level {provided}")
    warnings.warn(f"MPI was initialized with {level}, not MPI_THREAD_MULTIPLE; fusionring's "
                  f"background thread calls MPI while other threads may, which can crash or hang. "
                  f"Let mpi4py initialize MPI (its default is MPI_THREAD_MULTIPLE), or set "
                  f"mpi4py.rc.thread_level = 'multiple' before importing mpi4py.MPI.",
                  RuntimeWarning, stacklevel=3)


def usable_cores() -> List[int]:
    try:
        return list(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))
