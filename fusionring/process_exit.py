"""Leaving a failed job without MPI_Finalize.

After a peer died or stopped answering, MPI_Finalize can wait for it forever: a process that
saw the job fail must neither hang there nor report success to the launcher.
"""
from __future__ import annotations

import atexit
import os
import sys

_registered = False
_failed = False


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
        os._exit(1)

    atexit.register(_exit)


def recovered() -> None:
    """The job went on after the failure (every rank started a new runtime): end as usual."""
    global _failed
    _failed = False
