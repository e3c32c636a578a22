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


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed; ``run`` resets the state and calls the function again.

    Under mpiexec the world is fixed, so no launcher reports a host change; it is raised on
    every rank at a ``commit()`` after ``State.on_hosts_updated`` was called on rank 0, and a
    script may raise it itself (on every rank) to force a reset of
    ``fusionring.torch.elastic.run``. With `skip_sync` the state is not synced again.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = bool(skip_sync)
