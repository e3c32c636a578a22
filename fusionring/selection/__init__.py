"""Layer selection policies: which whole layers' gradients travel each step (the rest wait)."""
from __future__ import annotations

from typing import Optional

import torch

from .base import Accumulator, how_many, layers_of, top_k
from .hyper import HyperSelector
from .norm import NormSelector
from .random import RandomSelector
from .round_robin import RoundRobinSelector
from .selector import LayerSelector


class LayerSelection:
    """Factories for ``DistributedOptimizer(layer_selection=...)``."""

    @staticmethod
    def hyper(model: torch.nn.Module, fraction: Optional[float] = 0.25, ema: float = 0.9,
              hidden: int = 64, lr: float = 1e-3, max_wait: Optional[int] = None,
              k: Optional[int] = None, accumulate: bool = True,
              warmup_steps: int = 0) -> HyperSelector:
        """The hypernetwork selector (seed 002); ``accumulate=False`` takes this step's top k only.

        ``warmup_steps``: every layer travels for that many first steps (all selectors take it).
        """
        return HyperSelector(model, None if k is not None else fraction, k, ema, hidden, lr, max_wait,
                             accumulate=accumulate, warmup_steps=warmup_steps)

    @staticmethod
    def norm(fraction: Optional[float] = None, k: Optional[int] = None,
             max_wait: Optional[int] = None, model: Optional[torch.nn.Module] = None,
             warmup_steps: int = 0) -> NormSelector:
        return NormSelector(fraction, k, max_wait, model, warmup_steps)

    @staticmethod
    def round_robin(fraction: Optional[float] = None, k: Optional[int] = None,
                    max_wait: Optional[int] = None,
                    model: Optional[torch.nn.Module] = None,
                    warmup_steps: int = 0) -> RoundRobinSelector:
        return RoundRobinSelector(fraction, k, max_wait, model, warmup_steps)

    @staticmethod
    def random(fraction: Optional[float] = None, seed: int = 0, k: Optional[int] = None,
               max_wait: Optional[int] = None, model: Optional[torch.nn.Module] = None,
               warmup_steps: int = 0) -> RandomSelector:
        return RandomSelector(fraction, k, seed, max_wait, model, warmup_steps)


__all__ = ["LayerSelection", "LayerSelector", "HyperSelector", "NormSelector", "RandomSelector",
           "RoundRobinSelector", "Accumulator", "how_many", "layers_of", "top_k"]
