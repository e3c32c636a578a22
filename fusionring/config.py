"""The one place that reads ``FUSIONRING_*`` environment variables.

Every launch-time knob is read here, once, in a single unit that its name states
(bytes, milliseconds, seconds). Keyword arguments of the public API take precedence
over these values; the rest of the library asks :func:`settings` and never reads
``os.environ`` itself.

Horovod's documented variables for the same knobs (``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_CYCLE_TIME``, ``HOROVOD_TIMELINE``, the stall check's, ``HOROVOD_CACHE_CAPACITY``)
are honoured too, so a Horovod job's environment keeps its meaning; where both are set,
``FUSIONRING_*`` wins.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Optional

_PREFIX = "FUSIONRING_"

# fusionring's name -> Horovod's variable for the same knob, in the same unit (Horovod's
# fusion threshold is in bytes and its cycle time in milliseconds, as ours are).
HOROVOD_VARIABLES = {
    "CYCLE_TIME_MS": "HOROVOD_CYCLE_TIME",
    "FUSION_THRESHOLD": "HOROVOD_FUSION_THRESHOLD",
    "TIMELINE": "HOROVOD_TIMELINE",
    "TIMELINE_MARK_CYCLES": "HOROVOD_TIMELINE_MARK_CYCLES",
    "STALL_WARNING_S": "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "STALL_SHUTDOWN_S": "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "CACHE_CAPACITY": "HOROVOD_CACHE_CAPACITY",
}


def _lookup(name: str) -> Optional[tuple]:
    """(variable, value) of the first non-empty of FUSIONRING_<name> and Horovod's alias."""
    for variable in (_PREFIX + name, HOROVOD_VARIABLES.get(name)):
        raw = os.environ.get(variable) if variable else None
        if raw is not None and raw.strip() != "":
            return variable, raw.strip()
    return None


def _read(name: str, default, cast):
    found = _lookup(name)
    if found is None:
        return default
    variable, raw = found
    try:
        return cast(raw)
    except ValueError as exc:
        if cast in (int, float):
            raise ValueError(f"{variable}={raw!r} is not a valid {cast.__name__}") from exc
        raise ValueError(f"{variable}={raw!r}: {exc}") from exc


def _optional_seconds(raw: str) -> Optional[float]:
    value = float(raw)
    if math.isnan(value):
        raise ValueError(f"expected a number of seconds, got {raw!r}")
    return value if value > 0 else None


def _milliseconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected a number of milliseconds, got {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"expected a finite number of milliseconds >= 0, got {raw!r}")
    return value


def _factor(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a finite number > 0, got {raw!r}")
    return value


def _at_least(least: int) -> Callable[[str], int]:
    """A reader of whole numbers >= `least` (byte sizes the core needs to be positive)."""
    def read(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"expected a whole number of {least} or more, got {raw!r}") from None
        if value < least:
            raise ValueError(f"expected a whole number of {least} or more, got {raw!r}")
        return value
    return read


def _flag(raw: str) -> bool:
    value = raw.lower()
    if value in ("true", "on", "yes"):
        return True
    if value in ("false", "off", "no"):
        return False
    # As Horovod reads its switches (strtol(...) > 0): a number whose whole part is above 0 is on.
    try:
        return int(value) > 0
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"expected a number (above 0: on) or true/false, got {raw!r}")
    return math.trunc(number) > 0


def _timeline_path(raw: str) -> Optional[str]:
    # Horovod's HOROVOD_TIMELINE=DYNAMIC means "no file yet; start_timeline() opens one".
    return None if raw.upper() == "DYNAMIC" else raw


def _stall_check_disabled() -> bool:
    """Horovod's HOROVOD_STALL_CHECK_DISABLE: no stall warning and no stall shutdown."""
    raw = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip()
    try:
        return raw != "" and _flag(raw)
    except ValueError as exc:
        raise ValueError(f"HOROVOD_STALL_CHECK_DISABLE={raw!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Launch-time configuration, one unit per field (named in the field)."""

    cycle_time_ms: float = 1.0
    fusion_threshold_bytes: int = 64 * 1024 * 1024
    # A tensor at least this large is reduced where it lies rather than copied into the
    # threshold-fusion buffer and back: those two copies cost more than the collective's fixed
    # cost they save (0: copy every tensor, as Horovod does).
    pack_limit_bytes: int = 4 * 1024 * 1024
    # Threshold fusion without a plan: after the first step, keep the gradients smaller than
    # pack_limit_bytes as views of one buffer, in the order they became ready, so a fused batch
    # is reduced where it lies instead of being copied into the fusion buffer and back.
    gradient_buffer: bool = True
    timeline_path: Optional[str] = None
    timeline_mark_cycles: bool = False  # a marker per control-loop cycle (Horovod's default: off)
    stall_warning_s: Optional[float] = 60.0
    stall_shutdown_s: Optional[float] = None
    grouping_plan_path: Optional[str] = None
    ring_segment_bytes: int = 1 << 20
    small_message_bytes: int = 64 * 1024
    slowdown_factor: float = 1.0
    # Set by fusionrun: a folder where each rank on its host notes its process id, so that a
    # failed launch can say which rank a process id in MPI's messages was.
    rank_records_dir: Optional[str] = None
    # "auto": reduce through a shared-memory window when every rank shares this host (and
    # MPI is not told to avoid shared memory); "on": require it; "off": MPI transport only.
    shared_memory: str = "auto"
    shm_slot_bytes: int = 1 << 20
    # How CUDA tensors are allreduced: "auto" on the GPU where they lie, through NCCL, when
    # CuPy's NCCL binding loads (``pip install "fusionring[gpu]"``), else staged through host
    # memory over MPI; "on": require NCCL (an allreduce of a CUDA tensor fails without it);
    # "off": always stage through host memory.
    nccl: str = "auto"
    # Whether the loop gathers a backward pass's gradients (a burst) into one round: "auto"
    # when this host's ranks outnumber its cores (each round's CPU is taken from a peer
    # still computing); "on": always; "off": every submission starts a round at once.
    bursts: str = "auto"
    # How the background thread waits on MPI: "spin" polls nonstop (lowest latency on shared
    # memory); "sleep" polls briefly, then naps between tests (growing up to
    # mpi_wait_sleep_us), leaving the CPU to the kernel's network stack and to training while
    # bytes cross a network; "auto" sleeps when some ranks are on other hosts (or MPI is told
    # every peer is remote).
    mpi_wait: str = "auto"
    mpi_wait_sleep_us: int = 1000
    # "auto" on one host tests this long, yielding the core between tests, before it naps as
    # "sleep" does: a peer that shares the core runs at once, waits for a peer that is about to
    # answer stay as short as spinning (5 ms covers a late backward pass of a small model), and
    # a rank blocked on a late peer (or an idle runtime) stops costing a core.
    mpi_wait_spin_us: int = 5000
    # torch's intra-op threads per rank: "auto" lowers them at init() to the rank's share of
    # the host's cores when ranks would otherwise oversubscribe them (unless OMP_NUM_THREADS
    # or MKL_NUM_THREADS says otherwise); "off" leaves torch alone; a number sets it.
    torch_threads: str = "auto"
    # How many operation names the negotiation keeps cached (each is a bit of every cycle's
    # allreduce); beyond it the least recently ready name is dropped and, if used again,
    # negotiated again in full. 0: cache nothing.
    cache_capacity: int = 16384
    # Parameter server: how long a server waits on a silent worker (no message, not even the
    # heartbeat its process sends while it lives; and a worker on a silent server) before
    # failing with an error naming it. stall_shutdown_s, when set, takes precedence; this is
    # the limit when it is not. None (a value <= 0): no limit.
    ps_timeout_s: Optional[float] = 60.0
    # Parameter server: the nap between polls of MPI for messages, so an idle server leaves
    # the CPU to the workers sharing its host (0: poll without napping).
    ps_poll_sleep_us: int = 200
    # Parameter server: when set, each server records every event it handles (arrival order,
    # the decoded gradients, the hyper-parameters) and writes it to "<path>.server<rank>" at
    # exit, so a single process can replay the run (fusionring.ps.record). Debugging only: it
    # keeps every gradient in memory.
    ps_record_path: Optional[str] = None


def _from_environment() -> Settings:
    d = Settings()
    stall_off = _stall_check_disabled()
    return Settings(
        cycle_time_ms=_read("CYCLE_TIME_MS", d.cycle_time_ms, _milliseconds),
        fusion_threshold_bytes=_read("FUSION_THRESHOLD", d.fusion_threshold_bytes, _count),
        pack_limit_bytes=_read("PACK_LIMIT", d.pack_limit_bytes, _count),
        gradient_buffer=_read("GRADIENT_BUFFER", d.gradient_buffer, _flag),
        timeline_path=_read("TIMELINE", d.timeline_path, _timeline_path),
        timeline_mark_cycles=_read("TIMELINE_MARK_CYCLES", d.timeline_mark_cycles, _flag),
        stall_warning_s=_read_stall("STALL_WARNING_S", d.stall_warning_s, stall_off),
        stall_shutdown_s=_read_stall("STALL_SHUTDOWN_S", d.stall_shutdown_s, stall_off),
        grouping_plan_path=_read("GROUPING_PLAN", d.grouping_plan_path, str),
        ring_segment_bytes=_read("RING_SEGMENT_BYTES", d.ring_segment_bytes, _at_least(1)),
        small_message_bytes=_read("SMALL_MESSAGE_BYTES", d.small_message_bytes, _count),
        slowdown_factor=_read("SLOWDOWN", d.slowdown_factor, _factor),
        rank_records_dir=_read("RANK_RECORDS", d.rank_records_dir, str),
        shared_memory=_read("SHARED_MEMORY", _shared_memory_default(d.shared_memory), _mode),
        bursts=_read("BURSTS", d.bursts, _mode),
        nccl=_read("NCCL", d.nccl, _mode),
        shm_slot_bytes=_read("SHM_SLOT_BYTES", d.shm_slot_bytes, _at_least(4096)),
        mpi_wait=_read("MPI_WAIT", "sleep" if _mpi_peers_remote() else d.mpi_wait, _wait_mode),
        mpi_wait_sleep_us=_read("MPI_WAIT_SLEEP_US", d.mpi_wait_sleep_us, _count),
        mpi_wait_spin_us=_read("MPI_WAIT_SPIN_US", d.mpi_wait_spin_us, _count),
        torch_threads=_read("TORCH_THREADS", d.torch_threads, _threads),
        cache_capacity=_read("CACHE_CAPACITY", d.cache_capacity, _count),
        ps_timeout_s=_read("PS_TIMEOUT_S", d.ps_timeout_s, _optional_seconds),
        ps_poll_sleep_us=_read("PS_POLL_SLEEP_US", d.ps_poll_sleep_us, _count),
        ps_record_path=_read("PS_RECORD", d.ps_record_path, str),
    )


def _count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"expected a whole number of 0 or more, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"expected a count of 0 or more, got {raw!r}")
    return value


def _threads(raw: str) -> str:
    value = raw.lower()
    if value in ("auto", "off") or (value.isdigit() and int(value) > 0):
        return value
    raise ValueError(f"expected auto, off or a positive number, got {raw!r}")


# Variables through which a user already chose the thread count of torch's CPU kernels.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_count_chosen() -> Optional[str]:
    """The first of OMP_NUM_THREADS / MKL_NUM_THREADS that is set, else None."""
    for name in _THREAD_VARIABLES:
        if os.environ.get(name, "").strip():
            return name
    return None


def _read_stall(name: str, default: Optional[float], disabled: bool) -> Optional[float]:
    """A stall limit; HOROVOD_STALL_CHECK_DISABLE turns it off unless FUSIONRING_<name> is set
    (it outranks Horovod's own time settings, as in Horovod)."""
    if disabled and os.environ.get(_PREFIX + name, "").strip() == "":
        return None
    return _read(name, default, _optional_seconds)


def _mode(raw: str) -> str:
    value = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(raw.lower(), raw.lower())
    if value not in ("auto", "on", "off"):
        raise ValueError(f"expected auto, on or off, got {raw!r}")
    return value


def _wait_mode(raw: str) -> str:
    value = raw.lower()
    if value not in ("auto", "spin", "sleep"):
        raise ValueError(f"expected auto, spin or sleep, got {raw!r}")
    return value


def _mpi_peers_remote() -> bool:
    # MPICH told to treat every peer as remote (e.g. ranks in emulated hosts).
    return os.environ.get("MPIR_CVAR_NOLOCAL", "0").strip() not in ("", "0")


# What other launchers set to tell a process how many peers it has (torchrun, Open MPI's
# mpirun, MPICH's Hydra, horovodrun). Checked at init when MPI sees one process.
_LAUNCHER_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE")


# Set by MPI launchers (MPICH's hydra, Open MPI / PMIx) in every rank's environment.
_MPI_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def mpi_launch_variable() -> Optional[str]:
    """The first MPI launcher variable in the environment, else None."""
    return next((name for name in _MPI_RANK_VARIABLES if name in os.environ), None)


def launcher_connection() -> Optional[tuple]:
    """(descriptor, rank variable) when MPICH's launcher handed this process its connection
    as a descriptor number (``PMI_FD``, with ``PMI_RANK``), else None."""
    raw = os.environ.get("PMI_FD", "").strip()
    if not raw.isdigit() or "PMI_RANK" not in os.environ:
        return None
    return int(raw), "PMI_RANK"


def launcher_world_size() -> Optional[tuple]:
    """(variable, size) for the first launcher variable that announces more than one
    process, else None."""
    for name in _LAUNCHER_SIZE_VARIABLES:
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 1:
            return name, int(raw)
    return None


def _shared_memory_default(default: str) -> str:
    return "off" if _mpi_peers_remote() else default


_cached: Optional[Settings] = None


def settings(reload: bool = False) -> Settings:
    """Return the process's settings, read from the environment on first use."""
    global _cached
    if _cached is None or reload:
        _cached = _from_environment()
    return _cached
