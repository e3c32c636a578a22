"""Layer selection's shared part: which layers a model has, how a choice is made, what waits.

A layer is a module that owns parameters directly; its weight and bias travel together.
Every rank scores every layer, the scores are summed across ranks (a few hundred bytes), and
each rank takes the same top k (ties broken by layer index), so the chosen layers can travel
as one fused buffer on the plain ring. Layers not chosen keep their gradient locally (error
feedback) until they are chosen; ``max_wait`` forces a layer that has waited that many steps.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def layers_of(named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> List[List[str]]:
    """Group parameter names by owning module (the name up to its last dot), in first-seen order."""
    groups: Dict[str, List[str]] = {}
    for name, _ in named_parameters:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        groups.setdefault(owner, []).append(name)
    if not groups:
        raise ValueError("layer_selection: the model has no parameters")
    return list(groups.values())


def how_many(n_layers: int, fraction: Optional[float], k: Optional[int]) -> int:
    """The number of layers to send each step, from ``fraction`` or ``k`` (exactly one)."""
    if (fraction is None) == (k is None):
        raise ValueError("layer_selection: give exactly one of fraction= or k=")
    if k is not None:
        if not 1 <= int(k) <= n_layers:
            raise ValueError(f"layer_selection: k={k} must lie in [1, {n_layers}]")
        return int(k)
    if not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"layer_selection: fraction={fraction} must lie in (0, 1]")
    return max(1, min(n_layers, int(round(float(fraction) * n_layers))))


def top_k(scores: Sequence[float], k: int, forced: Sequence[int] = ()) -> List[int]:
    """Indices of the k largest scores, forced ones first; ties go to the lower index.

    Deterministic given the same scores, so every rank that holds the summed scores agrees.
    """
    chosen = list(dict.fromkeys(int(i) for i in forced))[:k]
    rest = sorted((i for i in range(len(scores)) if i not in chosen),
                  key=lambda i: (-float(scores[i]), i))
    return sorted(chosen + rest[: k - len(chosen)])


class Accumulator:
    """Per-layer error feedback: gradients not sent are added to the next step's."""

    def __init__(self, n_layers: int, max_wait: Optional[int] = None) -> None:
        if max_wait is not None and int(max_wait) < 1:
            raise ValueError(f"layer_selection: max_wait={max_wait} must be >= 1 or None")
        self.max_wait = None if max_wait is None else int(max_wait)
        self.residual: Dict[str, torch.Tensor] = {}
        # This step's own gradients (references, not copies) until settle(): what a policy
        # that learns from the task loss reads, wherever the gradient lives (.grad or a bucket).
        self.fresh: Dict[str, torch.Tensor] = {}
        self.waited = [0] * n_layers

    def add(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The gradient plus what this parameter has kept back (float32 for 16-bit gradients);
        the sum is what may be sent."""
        self.fresh[name] = grad
        kept = self.residual.get(name)
        # 16-bit gradients add up in float32: a layer that waits many steps would lose its
        # small gradients to the rounding of a 16-bit sum (a bfloat16 one keeps 8 bits).
        wide = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad.clone()
        return wide if kept is None else kept + wide

    def forced(self) -> List[int]:
        """Layers that have waited ``max_wait`` steps, longest first."""
        if self.max_wait is None:
            return []
        due = [i for i, w in enumerate(self.waited) if w >= self.max_wait]
        return sorted(due, key=lambda i: (-self.waited[i], i))

    def settle(self, chosen: Sequence[int], layers: Sequence[Sequence[str]],
               summed: Dict[str, torch.Tensor]) -> None:
        """Keep the unsent layers' sums, clear the sent ones, advance the wait counters."""
        chosen_set = set(chosen)
        self.fresh = {}
        for i, names in enumerate(layers):
            if i in chosen_set:
                self.waited[i] = 0
                for n in names:
                    self.residual.pop(n, None)
            else:
                self.waited[i] += 1
                for n in names:
                    if n in summed:
                        self.residual[n] = summed[n]

    def state_dict(self) -> dict:
        return {"residual": {k: v.clone() for k, v in self.residual.items()},
                "waited": list(self.waited), "max_wait": self.max_wait}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {k: v.clone() for k, v in state["residual"].items()}
        self.waited = list(state["waited"])
        self.max_wait = state["max_wait"]
