"""Checks before MPI_Init that a process started by a launcher, or by a rank, can join the job.

A process that only inherited a rank's launcher variables would abort inside MPI_Init with a
launcher error that does not say why; these name the cause. Used by the runtime's init() and by
the parameter server's.
"""
from __future__ import annotations

import os
import stat
import sys

from .config import launcher_connection, launcher_world_size, mpi_launch_variable
from .exceptions import FusionRingError


def not_a_lone_copy(MPI) -> None:
    """Fail when a launcher started several processes but MPI sees only this one.

    That happens under torchrun, or under another MPI's mpirun than the one mpi4py was
    built with: each process would train alone, silently, as a world of one.
    """
    announced = launcher_world_size()
    if announced is None:
        return
    variable, size = announced
    raise FusionRingError(
        f"{variable}={size}: this process was started as one of {size}, but MPI "
        f"({' '.join(MPI.Get_library_version().split()[:3])}) sees a world of 1. "
        f"fusionring's ranks are MPI processes: launch with `fusionrun -np {size} python ...` "
        f"or the mpirun/mpiexec of the MPI that mpi4py was built with, not torchrun or "
        f"another MPI's launcher (unset {variable} to run a single process).")


def not_a_worker_process(caller: str) -> None:
    """A process that multiprocessing started from a rank with spawn or forkserver (a
    DataLoader worker, say) inherits the rank's launcher variables but is no rank: MPI_Init
    would abort there with a launcher error. Name the cause instead (``caller``: the function
    the message names)."""
    import multiprocessing

    variable = mpi_launch_variable()
    # Such a process imports the script as a module named __mp_main__. (multiprocessing
    # also files the main module of any process under that key, with its own name; a forked
    # process keeps that one, and can still reach the launcher through the descriptors it
    # inherited.)
    imported_as = getattr(sys.modules.get("__mp_main__"), "__name__", None)
    if variable is None or imported_as != "__mp_main__":
        return
    raise FusionRingError(
        f"{caller} was called in process {os.getpid()} "
        f"({multiprocessing.current_process().name}), which multiprocessing started from MPI "
        f"rank {os.environ[variable]} ({variable} is inherited). Such a process, a DataLoader "
        f"worker with multiprocessing_context 'spawn' or 'forkserver' for example, imports the "
        f"script again and cannot join the job: call {caller} inside `if __name__ == "
        f"'__main__':` or a main() function, so that only the ranks run it.")


def launcher_reachable(caller: str) -> None:
    """A process that a rank started with ``subprocess`` (which closes inherited descriptors)
    inherits the rank's launcher variables but not its connection to the launcher: MPI_Init
    would abort there with a PMI write error. Name the cause instead (``caller``: the function
    the message names)."""
    found = launcher_connection()
    if found is None:
        return
    fd, variable = found
    try:
        connected = stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        connected = False
    if connected:
        return
    raise FusionRingError(
        f"{caller} was called in process {os.getpid()}, which inherited MPI rank "
        f"{os.environ[variable]}'s launcher variables ({variable}, PMI_FD={fd}) but not its "
        f"connection to the launcher (descriptor {fd} is not the launcher's socket here), as a "
        f"program that a rank starts with subprocess does. Such a process is no rank of the "
        f"job: launch it as a job of its own (`mpiexec -n N python ...`), or start it without "
        f"the PMI_* variables in its environment to run it as a world of one.")
