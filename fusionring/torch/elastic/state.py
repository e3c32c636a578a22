"""``horovod.torch.elastic.state``'s ``TorchState``: the elastic state of a PyTorch process.

Models, optimizers, LR schedulers and ``ElasticSampler`` values are committed through their
state_dict; anything else is a plain attribute of :class:`fusionring.common.elastic.ObjectState`.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch

from ...common.elastic import ObjectState, _check_attribute_name
from ..functions import (broadcast_object, broadcast_optimizer_state, broadcast_parameters,
                         rank)
from .sampler import ElasticSampler

__all__ = ["ObjectState", "TorchState"]


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
    kind = (ElasticSampler,)

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

