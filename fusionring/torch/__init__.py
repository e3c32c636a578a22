"""Horovod-compatible PyTorch API: ``import fusionring.torch as hvd``."""
from __future__ import annotations

from ..compression import Compression, Compressor
from ..selection import LayerSelection
from ..exceptions import (FusionRingError, HorovodInternalError, NotInitializedError, StallError,
                          TensorMismatchError)
from ..ops import ReduceOp
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .functions import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,
                        allgather_object, allreduce, allreduce_, allreduce_async, allreduce_async_,
                        alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                        broadcast_async_, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters, ccl_built, communication_stats, cross_rank,
                        cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                        grouped_allgather, grouped_allgather_async, grouped_allreduce,
                        grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter, grouped_reducescatter_async, init, is_homogeneous,
                        is_initialized, join, local_rank, local_size, mpi_built, mpi_enabled,
                        mpi_threads_supported, nccl_built, poll, rank, reducescatter,
                        reducescatter_async, rocm_built, shutdown, size, sparse_allreduce_async,
                        start_timeline, stop_timeline, synchronize)
from . import elastic
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
