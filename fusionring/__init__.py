"""fusionring: communication-efficient data-parallel training for PyTorch.

The Horovod-compatible API lives in :mod:`fusionring.torch`
(``import fusionring.torch as hvd``).
"""
__version__ = "0.1.0"

__all__ = ["run"]


def __getattr__(name: str):
    # fusionring.run (horovod.run): imported on first use, so `import fusionring.torch` stays light.
    if name == "run":
        from .runner import run

        return run
    raise AttributeError(f"module 'fusionring' has no attribute {name!r}")
