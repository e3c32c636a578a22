"""fusionring's parameter server: server ranks hold parameters, workers push gradients and pull parameters.

``init``/``shutdown``, ``save`` and the worker's ``DistributedOptimizer`` are in :mod:`.worker`, the server's loop in
:mod:`.server`, the messages in :mod:`.protocol`, gradient encoding in :mod:`.payload`, and the synchronization
policies (pure functions of the arrival order) in :mod:`.sync`.
"""
from .sync import DEFAULT_SLACK, SYNC_MODES, make_policy
from .worker import DistributedOptimizer, init, is_server, num_workers, save, shutdown, stats, worker_rank

__all__ = ["init", "shutdown", "DistributedOptimizer", "worker_rank", "num_workers", "is_server", "stats", "save",
           "SYNC_MODES", "DEFAULT_SLACK", "make_policy"]
