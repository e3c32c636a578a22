"""Horovod's elastic API (``hvd.elastic``) for a fixed set of ranks.

Scripts written for Horovod's elastic mode run unchanged under ``mpiexec -n N``:
``@hvd.elastic.run`` syncs the state from rank 0 before training, ``state.commit()``
keeps an in-memory copy to roll back to, and ``ElasticSampler`` partitions the samples
not yet processed this epoch. The MPI world of an mpiexec launch never changes, so no
launcher reports a host update (a script may, with ``State.on_hosts_updated``), and a
failed rank cannot be replaced: a ``HorovodInternalError`` rolls the state back to the last
commit and is raised again, saying so. Horovod's submodules resolve as here:
``.sampler`` (``ElasticSampler``) and ``.state`` (``TorchState``).
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from ...common.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                               run_fn)
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _reset() -> None:
    # Horovod shuts down and re-initializes here to take in the new set of ranks; the
    # ranks of an mpiexec launch are the same after a reset, so the runtime stays up.
    return None


def run(func: _F) -> _F:
    """Decorator for the elastic training function ``func(state, *args, **kwargs)``.

    Syncs `state` from rank 0 (every rank starts from rank 0's model, optimizer and
    committed attributes), then calls `func`. A ``HostsUpdatedInterrupt`` raised by `func`
    (or by a commit after ``state.on_hosts_updated``) resets the state and calls it again,
    as in Horovod. A ``HorovodInternalError`` (a rank failed or a collective broke) restores
    the last committed state and is raised again: the ranks of an mpiexec launch are fixed,
    so the failed rank cannot be replaced.
    """
    return run_fn(func, _reset)
