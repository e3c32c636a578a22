"""DistributedOptimizer's layer-selection path: agree on k layers, reduce only those.

Each step every rank adds its gradients to what it kept back, scores its layers, and the
scores are summed across ranks (one float64 per layer); every rank then takes the same top k.
The chosen layers' accumulated gradients travel as one fused buffer (compressed when asked);
the rest stay in the residual. Semantics after the step: a chosen layer's .grad holds the
average of the ranks' accumulated gradients; an unchosen layer's .grad is None, so the
wrapped optimizer skips it and every replica keeps identical parameters.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..compression import Compression
from . import functions as F


def reduce_selected(selection, params: List[torch.Tensor], names: Dict[torch.Tensor, str],
                    compression=Compression.none, process_set=None) -> List[int]:
    """Run one selected reduction over ``params``; returns the chosen layer indices."""
    acc = selection.acc
    by_name = {names[p]: p for p in params}
    summed = {}
    for n, p in by_name.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        summed[n] = acc.add(n, grad.detach())
    scores = torch.tensor(selection.scores(summed), dtype=torch.float64)
    total = F.allreduce(scores, op=F.Sum, name="layer_selection.scores",
                        process_set=process_set) if _size(process_set) > 1 else scores
    chosen = selection.choose(total.tolist())
    selection.step_count += 1
    sent = [n for i in chosen for n in selection.layers[i] if n in summed]
    if sent:
        flat = torch.cat([summed[n].reshape(-1) for n in sent])
        if _size(process_set) > 1:
            flat = F.allreduce(flat, op=F.Average, name="layer_selection.grads",
                               compression=compression, process_set=process_set)
        offset = 0
        for n in sent:
            p = by_name[n]
            count = p.numel()
            p.grad = flat[offset:offset + count].view_as(p).to(p.dtype).clone()
            offset += count
    sent_set = set(sent)
    for n, p in by_name.items():
        if n not in sent_set:
            p.grad = None
    acc.settle(chosen, selection.layers, summed)
    return chosen


def _size(process_set) -> int:
    return F.size() if process_set is None else process_set.size()
