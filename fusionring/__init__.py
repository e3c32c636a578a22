"""fusionring: communication-efficient data-parallel training for PyTorch.

The Horovod-compatible API lives in :mod:`fusionring.torch`
(``import fusionring.torch as hvd``).
"""
__version__ = "0.1.0"
