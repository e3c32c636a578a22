"""Leaving a failed job without MPI_Finalize, and the note that lets fusionrun name a killed rank.

After a peer died or stopped answering, MPI_Finalize can wait for it forever: a process that
saw the job fail must neither hang there nor report success to the launcher.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from typing import Callable

from .config import settings

_registered = False
_failed = False
_hooked = False


def exit_nonzero_without_finalize() -> None:
    """Make this process end with status 1 and without MPI_Finalize, once its error has been
    printed. Registered once, on the first fatal error: Python runs it before the exit hooks
    registered earlier (fusionring's shutdown, mpi4py's MPI_Finalize), and after printing an
    uncaught exception's traceback. ``recovered()`` (a new runtime after the failure) takes
    it back."""
    global _registered, _failed
    _failed = True
    if _registered:
        return
    _registered = True

    def _exit() -> None:
        if not _failed:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
                pass
        unlink_mpi_shared_memory()
        os._exit(1)

    atexit.register(_exit)


# MPICH keeps its node's shared-memory segment under this name until MPI_Finalize unlinks it;
# the segments it unlinks at once show up in /proc/self/maps marked "(deleted)".
_MPICH_SEGMENT_PREFIX = "/dev/shm/mpich_shm_"


def unlink_mpi_shared_memory() -> None:
    """Remove the shared-memory file of MPICH's node segment that this process maps, before it
    ends without MPI_Finalize (which would have removed it). Otherwise each failed job leaves
    2-3 MB in /dev/shm, which a container's 64 MB /dev/shm runs out of after a few dozen
    failures, and MPI_Init then fails. The peers on this node keep their mapping: unlinking a
    file leaves existing mappings intact, and MPICH opens it by name only inside MPI_Init."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return  # not Linux: nothing known to clean
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5]
        if path.startswith(_MPICH_SEGMENT_PREFIX) and not path.endswith("(deleted)"):
            try:
                os.unlink(path)
            except OSError:
                pass  # a peer on this node removed it first


def recovered() -> None:
    """The job went on after the failure (every rank started a new runtime): end as usual."""
    global _failed
    _failed = False


def exit_on_uncaught(cleanup: Callable[[], None]) -> None:
    """Once: an exception that ends the script (``KeyboardInterrupt`` too) ends this process with
    status 1 right after its traceback and ``cleanup()``, without MPI_Finalize. Under MPICH,
    MPI_Finalize waits for every other rank to finalize, so a peer busy outside the library (an
    evaluation, a stuck data loader) would keep the failed rank, and with it the job, alive; a
    process that exits unfinalized makes the launcher end the job at once. In an interactive
    interpreter an exception ends nothing, and it is left alone."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        if hasattr(sys, "ps1") or sys.flags.interactive:
            return
        try:
            cleanup()
        except BaseException:  # noqa: BLE001 - the exception being reported matters more
            pass
        exit_nonzero_without_finalize()

    sys.excepthook = hook


def record_process(rank: int) -> None:
    """Under fusionrun, note this rank's process id where the launcher reads it back if the
    job fails (MPICH's launcher names a dead process only by its id)."""
    folder = settings().rank_records_dir
    if not folder or not os.path.isdir(folder):
        return  # not launched by fusionrun, or on another host than the launcher
    try:
        with open(os.path.join(folder, f"rank.{rank}"), "w") as out:
            out.write(f"{os.getpid()} {socket.gethostname()}\n")
    except OSError:
        pass  # a note for error messages only: never a reason to fail
