"""The names of Horovod's ``horovod.torch.mpi_ops`` module, for scripts that import it by name
(``from horovod.torch.mpi_ops import allreduce_async_`` with only ``horovod`` changed).

Everything here is the object ``fusionring.torch`` exports under the same name; this module
adds nothing of its own.
"""
from __future__ import annotations

import fusionring.torch as _package

__all__ = [name for name in _package.__all__
           if name not in ("elastic", "functions", "optimizer", "sync_batch_norm",
                           "DistributedOptimizer", "SyncBatchNorm")]
globals().update({name: getattr(_package, name) for name in __all__})
