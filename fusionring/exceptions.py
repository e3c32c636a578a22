"""Exceptions raised by fusionring (one hierarchy; core errors map into it)."""
from __future__ import annotations


class FusionRingError(RuntimeError):
    """A collective failed or the runtime was shut down; raised on every rank involved."""


class TensorMismatchError(FusionRingError):
    """Ranks submitted the same tensor name with different shape, dtype, op or root."""


class StallError(FusionRingError):
    """Some ranks never submitted a tensor the others are waiting for."""


class NotInitializedError(ValueError):
    """An operation was called before ``init()`` (Horovod raises ValueError here too)."""

    def __init__(self, what: str = "this operation") -> None:
        super().__init__(f"fusionring has not been initialized; call fusionring.torch.init() "
                         f"before {what}.")


# Horovod-compatible name, so `except hvd.HorovodInternalError` keeps working.
HorovodInternalError = FusionRingError
