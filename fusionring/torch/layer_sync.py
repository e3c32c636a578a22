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

from typing import List, Optional

import torch

from ..compression import Compression, capabilities
from . import functions as F


def reduce_selected(selection, params: List[torch.Tensor], compression=Compression.none,
                    process_set=None, op=F.Average) -> List[int]:
    """Run one selected reduction over ``params`` with ``op`` (Average or Sum); returns the chosen
    layer indices."""
    acc = selection.acc
    names = selection.names()
    by_name = {names[id(p)]: p for p in params}
    summed = {}
    for n, p in by_name.items():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        summed[n] = acc.add(n, grad.detach())
    scores = torch.tensor(selection.scores(summed), dtype=torch.float64)
    multi = _size(process_set) != 1  # None: a set no longer added, refused by the allreduce
    total = F.allreduce(scores, op=F.Sum, name="layer_selection.scores",
                        process_set=process_set) if multi else scores
    chosen = selection.choose(total.tolist())
    selection.step_count += 1
    # in layer order: the group's layout, which per-rank masks depend on, then repeats
    sent = [n for i in sorted(chosen) for n in selection.layers[i] if n in summed]
    for n in sent:  # a 16-bit layer's float32 sum travels in its own dtype
        summed[n] = summed[n].to(by_name[n].dtype)
    if multi and sent:
        _reduce(sent, summed, compression, process_set, op)
    for n in sent:
        p = by_name[n]
        p.grad = summed[n].view_as(p).to(p.dtype)
    sent_set = set(sent)
    for n, p in by_name.items():
        if n not in sent_set:
            p.grad = None
    acc.settle(chosen, selection.layers, summed)
    return chosen


def _reduce(sent: List[str], summed, compression, process_set, op=F.Average) -> None:
    """Reduce (``op``: Average or Sum) the chosen gradients in place of ``summed``, as one group of
    requests.

    Each parameter keeps its own name on the wire (``layer_selection.<name>``) rather than one
    buffer of a layout that changes every step: a compressor's residual (N:M, the cluster
    quantizer) is kept per name, and must come back to the parameter it was taken from. The
    requests form one group, fused into the same batches whenever the same layers travel:
    with per-rank masks the batch decides which elements share a group of M, so batches made
    by timing would make runs differ.
    """
    # The accumulated sums are reduced in place: they are copies (Accumulator.add), and what
    # the residual keeps of a sent layer is dropped in settle().
    for n in sent:
        summed[n] = summed[n].contiguous()
    names = [f"layer_selection.{n}" for n in sent]
    if capabilities(compression).in_runtime:
        F.synchronize(F._grouped_allreduce_named_async_(
            [summed[n] for n in sent], names, op=op, compression=compression,
            process_set=process_set))
        return
    encoded = [compression.compress(summed[n]) for n in sent]
    for (payload, _), name in zip(encoded, names):
        F.check_summable(compression, payload, name)
    payloads = [payload for payload, _ in encoded]
    F.synchronize(F._grouped_allreduce_named_async_(payloads, names, op=op,
                                                    process_set=process_set))
    for (payload, ctx), n in zip(encoded, sent):
        summed[n] = compression.decompress(payload, ctx)


def _size(process_set) -> Optional[int]:
    return F.size() if process_set is None else process_set.size()
