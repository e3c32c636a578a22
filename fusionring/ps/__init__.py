"""fusionring's parameter server: server ranks hold parameters, workers push gradients and pull parameters.

This package holds the synchronization policies (``fusionring.ps.sync``): the server's decisions per push, as
pure functions of the arrival order.
"""
from .sync import SYNC_MODES, DEFAULT_SLACK, make_policy  # noqa: F401
