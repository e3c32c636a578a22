"""fusionring's parameter server: server ranks hold parameters, workers push gradients and pull parameters.

Today this package holds the synchronization policies (``fusionring.ps.sync``); the server, worker and
``DistributedOptimizer`` build on them.
"""
from .sync import SYNC_MODES, DEFAULT_SLACK, make_policy  # noqa: F401
