"""Baseline: the layers with the largest accumulated gradient norm per element."""
from __future__ import annotations

from typing import Dict, List

import torch

from .selector import LayerSelector


class NormSelector(LayerSelector):
    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        squares = _squares({n: t for names in self.layers for n in names
                            if (t := summed.get(n)) is not None})
        out = []
        for names in self.layers:
            sq = sum(squares[n] for n in names if n in summed)
            count = sum(summed[n].numel() for n in names if n in summed)
            out.append((sq / count) ** 0.5 if count else 0.0)
        return out


def _squares(tensors: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Each tensor's sum of squares in double, read in one copy per device (not one host
    synchronization per tensor of a GPU model)."""
    by_device: Dict[torch.device, List[str]] = {}
    for n, t in tensors.items():
        by_device.setdefault(t.device, []).append(n)
    out: Dict[str, float] = {}
    for names in by_device.values():
        values = torch.stack([tensors[n].double().pow(2).sum() for n in names]).tolist()
        out.update(zip(names, values))
    return out
