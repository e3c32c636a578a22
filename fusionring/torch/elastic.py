"""Horovod's elastic API (``hvd.elastic``) for a fixed set of ranks.

Scripts written for Horovod's elastic mode run unchanged under ``mpiexec -n N``:
``@hvd.elastic.run`` syncs the state from rank 0 before training, ``state.commit()``
keeps an in-memory copy to roll back to, and ``ElasticSampler`` partitions the samples
not yet processed this epoch. The MPI world of an mpiexec launch never changes, so no
host update ever arrives, and a failed rank cannot be replaced: a ``HorovodInternalError``
rolls the state back to the last commit and is raised again, saying so.
"""
from __future__ import annotations

import copy
import functools
import math
import random
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, TypeVar

import torch

from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt, NotInitializedError
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters, is_initialized, rank, size)

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]

_F = TypeVar("_F", bound=Callable[..., Any])


# ---------------------------------------------------------------------- state
class State:
    """State kept in memory on every rank: committed, restored and synced together.

    Args:
        bcast_object: broadcasts an object from rank 0 and returns it on every rank.
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Add functions called after a reset event, before the state is synced again."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callbacks must be callable, got "
                                f"{type(callback).__name__}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Reset this state's objects, then run the registered reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (the point ``restore()`` returns to), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` if hosts were added or removed.

        The ranks of an mpiexec launch are fixed for the whole job, so there is never an
        update to report and this returns at once, with no communication.
        """
        return None

    def save(self) -> None:
        """Save the state to host memory."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Return to the last saved state, undoing changes made since."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")

    def reset(self) -> None:
        """Reset objects after a reset event, before the state is synced."""
        return None


def _deepcopy(value: Any, name: str) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception as exc:  # noqa: BLE001 - any failure of an arbitrary object's copy
        raise TypeError(f"elastic state attribute '{name}' ({type(value).__name__}) cannot be "
                        f"deep-copied, so it cannot be committed or restored: {exc}") from exc


class ObjectState(State):
    """State made of plain Python attributes, one per keyword argument.

    ``save`` keeps deep copies, so later in-place changes (``state.history.append(x)``)
    are undone by ``restore``; ``sync`` broadcasts rank 0's values with `bcast_object`.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        for name in kwargs:
            _check_attribute_name(type(self), name)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: Dict[str, Any] = {name: _deepcopy(value, name)
                                             for name, value in kwargs.items()}
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved_state = {name: _deepcopy(getattr(self, name), name)
                             for name in self._saved_state}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if not self._saved_state:
            return
        current = {name: getattr(self, name) for name in self._saved_state}
        synced = self._bcast_object(current)
        for name, value in synced.items():
            setattr(self, name, value)
        # A restore before the next commit must not take a rank back to its own values.
        self._saved_state = {name: _deepcopy(value, name) for name, value in synced.items()}


def _check_attribute_name(cls: type, name: str) -> None:
    if name.startswith("_") or hasattr(cls, name):
        raise ValueError(f"'{name}' cannot be an elastic state attribute: it starts with '_' or "
                         f"is the name of a {cls.__name__} method")


# ---------------------------------------------------------------------- torch handlers
class _Handler:
    """Commits, restores and syncs one object that has its own state_dict."""

    kind: Tuple[type, ...] = ()

    def __init__(self, value: Any) -> None:
        self.value = value
        self._snapshot()

    def _snapshot(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self._snapshot()

    def restore(self) -> None:
        # load_state_dict may keep the tensors it is given (optimizers do): hand it a copy
        # so that the saved state survives the training steps that follow.
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self._broadcast()
        self._snapshot()

    def _broadcast(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), 0))

    def reset(self) -> None:
        return None

    def set_value(self, value: Any) -> None:
        self.value = value
        self._snapshot()


class _ModelHandler(_Handler):
    kind = (torch.nn.Module,)

    def _broadcast(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    kind = (torch.optim.Optimizer,)

    def _broadcast(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SchedulerHandler(_Handler):
    kind = tuple({cls for cls in (getattr(torch.optim.lr_scheduler, "LRScheduler", None),
                                  getattr(torch.optim.lr_scheduler, "_LRScheduler", None),
                                  getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None))
                  if cls is not None})


class _SamplerHandler(_Handler):
    kind: Tuple[type, ...] = ()  # set below, once ElasticSampler exists

    def save(self) -> None:
        self.value._share_recorded_indices()
        self._snapshot()

    def sync(self) -> None:
        self.value._share_recorded_indices()
        super().sync()

    def reset(self) -> None:
        self.value.reset()


def _handler_for(value: Any) -> Optional[_Handler]:
    # Samplers first: a sampler is never one of the others, and the order is the sync order.
    for handler_cls in (_SamplerHandler, _ModelHandler, _OptimizerHandler, _SchedulerHandler):
        if handler_cls.kind and isinstance(value, handler_cls.kind):
            return handler_cls(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process: models, optimizers, samplers and counters.

    Every keyword argument becomes an attribute (``state.model``, ``state.epoch``).
    Modules, optimizers, LR schedulers and ``ElasticSampler`` values are committed through
    their state_dict (models synced with ``broadcast_parameters``, optimizers with
    ``broadcast_optimizer_state``); anything else is an object attribute, deep-copied on
    commit and synced with ``broadcast_object``.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            _check_attribute_name(type(self), name)
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None:
            if not isinstance(value, handler.kind):
                raise TypeError(f"state.{name} holds a {type(handler.value).__name__}; it "
                                f"cannot be replaced by a {type(value).__name__}")
            handler.set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()


# ---------------------------------------------------------------------- sampler
class ElasticSampler(torch.utils.data.Sampler):
    """Partitions the samples not yet processed this epoch across the ranks.

    Like ``DistributedSampler``: the epoch's order (shuffled with ``seed + epoch`` when
    `shuffle`, the same on every rank) is padded by repeating its first indices until it
    divides evenly, and rank r takes every size()-th index starting at r, so every rank
    has ``len(sampler)`` samples. ``record_batch`` marks a batch as processed on every
    rank; ``reset()`` re-partitions what is left. Keep it in a ``TorchState`` so commits
    save its progress, and call ``set_epoch`` at the end of each epoch.

    Args:
        dataset: the dataset to sample (of constant size).
        shuffle: shuffle the indices each epoch (default True).
        seed: shuffling seed, the same on every rank (default 0).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        # Indices from record_indices() that other ranks have not seen yet.
        self._unshared: Set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._padded: List[int] = []
        self.reset()

    def _epoch_order(self) -> List[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Re-partition the indices not processed yet this epoch across the ranks."""
        if is_initialized():
            self.num_replicas, self.rank = size(), rank()
        elif self.num_replicas == 0:
            raise NotInitializedError("creating an ElasticSampler")
        self.remaining_indices = [i for i in self._epoch_order()
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:  # fewer samples than ranks: repeat
            padded += self.remaining_indices[:self.total_size - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a new order (seed + epoch) and no processed indices."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self._unshared = set()
        self.reset()

    def _batch_bounds(self, batch_idx: int, batch_size: int) -> Tuple[int, int]:
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"batch_idx must be >= 0 and batch_size >= 1, got {batch_idx} "
                             f"and {batch_size}")
        start = min(batch_idx * batch_size, self.num_samples)
        return start, min(start + batch_size, self.num_samples)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch `batch_idx` of the current partition."""
        start, stop = self._batch_bounds(batch_idx, batch_size)
        return self.indices[start:stop]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` as processed, on every rank's share of the partition.

        Every rank trains on its batch `batch_idx` in the same step, and the partition is
        the same everywhere, so each rank records all ranks' samples of that step.
        """
        start, stop = self._batch_bounds(batch_idx, batch_size)
        self.processed_indices.update(
            self._padded[start * self.num_replicas:stop * self.num_replicas])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset indices processed by this rank; shared with all ranks on commit."""
        indices = {int(i) for i in indices}
        self.processed_indices.update(indices)
        self._unshared.update(indices)

    def _share_recorded_indices(self) -> None:
        """Merge every rank's ``record_indices`` (a collective call, on every rank)."""
        for recorded in allgather_object(sorted(self._unshared)):
            self.processed_indices.update(recorded)
        self._unshared = set()

    def state_dict(self) -> Dict[str, Any]:
        """The epoch and the processed indices (as seen by this rank)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a ``state_dict()`` and re-partition.

        Horovod's newer ``{"epoch", "processed_num"}`` form (the first processed_num
        indices of the epoch's order) is accepted too.
        """
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        elif "processed_num" in state_dict:
            self.processed_indices = set(self._epoch_order()[:int(state_dict["processed_num"])])
        else:
            raise KeyError("ElasticSampler state_dict needs 'processed_indices' or "
                           "'processed_num'")
        self._unshared = set()
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


_SamplerHandler.kind = (ElasticSampler,)


# ---------------------------------------------------------------------- run
def _fixed_world_error(exc: BaseException) -> BaseException:
    message = (f"{exc}\nThe elastic state was restored to its last commit, but training cannot "
               f"go on in this launch: recovering from a failed rank needs a launcher that can "
               f"replace ranks, and the MPI world of an mpiexec launch is fixed. Restart the job "
               f"(e.g. from a checkpoint of the committed state).")
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - a subclass whose constructor takes other arguments
        return HorovodInternalError(message)


def run(func: _F) -> _F:
    """Decorator for the elastic training function ``func(state, *args, **kwargs)``.

    Syncs `state` from rank 0 (every rank starts from rank 0's model, optimizer and
    attributes), then calls `func`. A ``HostsUpdatedInterrupt`` raised by `func` resets
    the state and calls it again, as in Horovod. A ``HorovodInternalError`` (a rank failed
    or a collective broke) restores the last committed state and is raised again: the
    ranks of an mpiexec launch are fixed, so the failed rank cannot be replaced.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an elastic function must be an elastic "
                            f"State (e.g. hvd.elastic.TorchState), not {type(state).__name__}")
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                state.restore()
                raise _fixed_world_error(exc) from exc
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            state.on_reset()

    return wrapper  # type: ignore[return-value]
