"""DistributedOptimizer's layer-selection path: agree on k layers, reduce only those.

Each step every rank adds its gradients to what it kept back, scores its layers, and the
scores are summed across ranks (one float64 per layer); every rank then takes the same top k.
The chosen layers' accumulated gradients are submitted together and travel in one fused
batch (compressed when asked); the rest stay in the residual. Semantics after the step: a
chosen layer's .grad holds the average of the ranks' accumulated gradients; an unchosen
layer's .grad is None, so the wrapped optimizer skips it and every replica keeps identical
parameters.
"""
from __future__ import annotations

from typing import List

import torch

from ..compression import Compression, capabilities
from . import functions as F


def reduce_selected(selection, params: List[torch.Tensor], compression=Compression.none,
                    process_set=None) -> List[int]:
    """Run one selected reduction over ``params``; returns the chosen layer indices."""
    acc = selection.acc
    names = selection.names()
    by_name = {names[id(p)]: p for p in params}
    summed = {}
    for n, p in by_name.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        summed[n] = acc.add(n, grad.detach())
    scores = torch.tensor(selection.scores(summed), dtype=torch.float64)
    multi = _size(process_set) > 1
    total = F.allreduce(scores, op=F.Sum, name="layer_selection.scores",
                        process_set=process_set) if multi else scores
    chosen = selection.choose(total.tolist())
    selection.step_count += 1
    sent = [n for i in chosen for n in selection.layers[i] if n in summed]
    if multi and sent:
        _reduce(sent, summed, compression, process_set)
    for n in sent:
        p = by_name[n]
        p.grad = summed[n].view_as(p).to(p.dtype)
    sent_set = set(sent)
    for n, p in by_name.items():
        if n not in sent_set:
            p.grad = None
    acc.settle(chosen, selection.layers, summed)
    return chosen


def _reduce(sent: List[str], summed, compression, process_set) -> None:
    """Average the chosen gradients in place of ``summed``, one request per parameter.

    Each parameter keeps its own name on the wire (``layer_selection.<name>``) rather than one
    buffer of a layout that changes every step: a compressor's residual (N:M, the cluster
    quantizer) is kept per name, and must come back to the parameter it was taken from. The
    requests are submitted back to back, so the runtime fuses them into one batch.
    """
    # The accumulated sums are reduced in place: they are copies (Accumulator.add), and what
    # the residual keeps of a sent layer is dropped in settle().
    for n in sent:
        summed[n] = summed[n].contiguous()
    if capabilities(compression).in_runtime:
        handles = [F.allreduce_async_(summed[n], name=f"layer_selection.{n}", op=F.Average,
                                      compression=compression, process_set=process_set)
                   for n in sent]
        for h in handles:
            F.synchronize(h)
        return
    encoded = [compression.compress(summed[n]) for n in sent]
    for (payload, _), n in zip(encoded, sent):
        F.check_summable(compression, payload, f"layer_selection.{n}")
    handles = [F.allreduce_async_(payload, name=f"layer_selection.{n}", op=F.Average,
                                  process_set=process_set)
               for (payload, _), n in zip(encoded, sent)]
    for h, (payload, ctx), n in zip(handles, encoded, sent):
        F.synchronize(h)
        summed[n] = compression.decompress(payload, ctx)


def _size(process_set) -> int:
    return F.size() if process_set is None else process_set.size()
