"""Baseline: k consecutive layers per step, cycling through the model."""
from __future__ import annotations

from typing import Dict, List

import torch

from .selector import LayerSelector


class RoundRobinSelector(LayerSelector):
    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        n = len(self.layers)
        start = (self.step_count * self.k) % n
        return [float(n - ((i - start) % n)) for i in range(n)]
