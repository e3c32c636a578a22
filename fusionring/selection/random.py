"""Baseline: k layers drawn at random; every rank draws the same from the same seed."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .selector import LayerSelector, integer


class RandomSelector(LayerSelector):
    def __init__(self, fraction: Optional[float] = None, k: Optional[int] = None, seed: int = 0,
                 max_wait: Optional[int] = None, model: Optional[torch.nn.Module] = None,
                 warmup_steps: int = 0) -> None:
        self.seed = integer(seed)
        if self.seed is None:
            raise ValueError(f"layer_selection: seed={seed!r} must be an integer")
        self.generator = torch.Generator().manual_seed(self.seed)
        super().__init__(fraction, k, max_wait, model, warmup_steps)

    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        return torch.rand(len(self.layers), generator=self.generator, dtype=torch.float64).tolist()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.generator.set_state(state["rng"])
