"""Baseline: the layers with the largest accumulated gradient norm per element."""
from __future__ import annotations

from typing import Dict, List

import torch

from .selector import LayerSelector


class NormSelector(LayerSelector):
    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        out = []
        for names in self.layers:
            sq = sum(float(summed[n].double().pow(2).sum()) for n in names if n in summed)
            count = sum(summed[n].numel() for n in names if n in summed)
            out.append((sq / count) ** 0.5 if count else 0.0)
        return out
