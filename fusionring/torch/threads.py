"""torch's intra-op threads when several ranks share a host's cores.

Under MPICH's and Open MPI's launchers torch already starts with one thread per rank (its
math library sees `MPI_LOCALNRANKS` / `OMPI_COMM_WORLD_LOCAL_SIZE`). Other launches (a launcher
that sets only `PMI_*` variables and binds no cores, a script that sets the count itself) give
every rank a thread per core, which oversubscribes the cores many times over; OpenMP's
spinning workers then fight the ranks' communication threads. Measured with 4 ranks on 2
cores and 2 threads each (small model of `scripts/bench_fusion.py`): 3.0-5.4 s per step
instead of 0.12 s. ``init()`` therefore lowers the count to each rank's share of the cores
unless the user chose one through the environment.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from ..config import settings, thread_count_chosen


def fit_intra_op_threads(runtime) -> Optional[int]:
    """Apply FUSIONRING_TORCH_THREADS for this rank; return the new count, or None if torch
    was left as it was."""
    setting = settings().torch_threads
    if setting == "off":
        return None
    current = torch.get_num_threads()
    if setting != "auto":
        wanted = int(setting)
    else:
        if thread_count_chosen() is not None:
            return None
        wanted = max(1, int(runtime.core_share() + 1e-9))
        if wanted >= current:
            return None  # never raise a count someone lowered on purpose
    if wanted == current:
        return None
    torch.set_num_threads(wanted)
    if setting == "auto" and runtime.local_rank == 0:
        print(f"fusionring: {runtime.local_size} ranks share {runtime.host_cores()} cores on this host; torch "
              f"now runs {wanted} intra-op thread(s) per rank instead of {current}. Set "
              f"OMP_NUM_THREADS, or FUSIONRING_TORCH_THREADS=off, to choose yourself.",
              file=sys.stderr, flush=True)
    return wanted
