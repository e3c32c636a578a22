"""The hypernetwork selector: an embedding -> two FC layers -> sigmoid, one alpha per layer.

The objective is the task loss with each layer's weights taken times its alpha. The model's
parameters stand for that product (W_l = alpha_l * V_l), so training the hypernetwork costs no
second forward pass and leaves the model's function untouched: the model
is read as W_l * (alpha_l / stopgrad(alpha_l)), whose value is W_l, so the task loss's gradient
with respect to alpha_l is <dL/dW_l, W_l> / alpha_l, computed from the gradients backward has
already produced (pushed into the logits as <dL/dW_l, W_l> (1 - alpha_l), which stays finite
where a sigmoid underflows). That gradient is pushed through the hypernetwork with its own Adam. A layer's
selection probability is the EMA of |alpha_t - alpha_{t-1}|.

Which k are sent: with ``accumulate=True`` (the default) a layer's probability accumulates while it
waits, as its gradient does. Each step every layer earns its share of the step's k sends
(k * p_l / sum(p), from the probabilities summed across ranks), the k layers that have earned
the most since they were last sent travel, and theirs starts again from zero. A layer that
the hypernetwork rates rarely is sent rarely, but it is sent: taking this step's k most
probable alone (``accumulate=False``) lets a layer whose alpha has stopped moving wait for
the whole run.
"""
from __future__ import annotations

import copy

from typing import Dict, List, Optional, Sequence

import torch

from .base import top_k
from .selector import LayerSelector


class HyperSelector(LayerSelector):
    def __init__(self, model: Optional[torch.nn.Module] = None, fraction: Optional[float] = None,
                 k: Optional[int] = None, ema: float = 0.9, hidden: int = 64, lr: float = 1e-3,
                 max_wait: Optional[int] = None, seed: int = 0, accumulate: bool = True,
                 warmup_steps: int = 0) -> None:
        if not 0.0 <= float(ema) < 1.0:
            raise ValueError(f"layer_selection: ema={ema} must lie in [0, 1)")
        if int(hidden) < 1:
            raise ValueError(f"layer_selection: hidden={hidden} must be >= 1")
        if not float(lr) > 0.0:
            raise ValueError(f"layer_selection: lr={lr} must be > 0")
        self.ema, self.hidden, self.lr, self.seed = float(ema), int(hidden), float(lr), int(seed)
        self.accumulate = bool(accumulate)
        super().__init__(fraction, k, max_wait, model, warmup_steps)

    def _attached(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        n = len(self.layers)
        self.embedding = torch.nn.Parameter(torch.randn(self.hidden, generator=g))
        self.fc1 = torch.nn.Linear(self.hidden, self.hidden)
        self.fc2 = torch.nn.Linear(self.hidden, n)
        with torch.no_grad():
            for p in list(self.fc1.parameters()) + list(self.fc2.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * self.hidden ** -0.5)
        self.net_params = [self.embedding, *self.fc1.parameters(), *self.fc2.parameters()]
        self.optimizer = torch.optim.Adam(self.net_params, lr=self.lr, foreach=True)
        self.prev_alpha: Optional[torch.Tensor] = None
        self.prob = torch.zeros(n, dtype=torch.float64)
        # Each layer's share of the sends earned since it was last sent (accumulate=True).
        self.credit = [0.0] * n

    def logits(self) -> torch.Tensor:
        """The hypernetwork's output, one per layer (with its graph: scores() trains through it)."""
        return self.fc2(torch.relu(self.fc1(self.embedding)))

    def alpha(self) -> torch.Tensor:
        """Each layer's current weight, sigmoid(logits), as plain values without a graph."""
        with torch.no_grad():
            return torch.sigmoid(self.logits())

    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        """Train the hypernetwork one step on this step's gradients, then score by smoothed change."""
        logits = self.logits()
        alpha = torch.sigmoid(logits.detach())
        with torch.no_grad():
            # One dot per parameter, summed per layer with one index_add (no per-layer sync).
            dots, owners = [], []
            for i, names in enumerate(self.layers):
                for n in names:
                    p = self.params[n]
                    grad = self.acc.fresh.get(n, p.grad) if self.acc is not None else p.grad
                    if grad is not None:
                        dots.append(torch.dot(grad.reshape(-1).to(p.dtype), p.detach().reshape(-1)))
                        owners.append(i)
            dot = torch.zeros(len(self.layers), dtype=alpha.dtype)
            if dots:
                # the hypernetwork lives on the host: a GPU model's dots come over in one copy
                dot.index_add_(0, torch.tensor(owners),
                               torch.stack(dots).to(device=dot.device, dtype=alpha.dtype))
            # dL/dalpha = <g, W> / alpha, and dalpha/dlogit = alpha (1 - alpha): the gradient
            # at the logits is <g, W> (1 - alpha), finite where alpha underflows to 0.
            d_logits = dot * (1.0 - alpha)
        self.optimizer.zero_grad(set_to_none=True)
        logits.backward(d_logits)
        self.optimizer.step()
        with torch.no_grad():
            now = self.alpha().double()
            change = torch.zeros_like(now) if self.prev_alpha is None else (now - self.prev_alpha).abs()
            self.prob = self.ema * self.prob + (1.0 - self.ema) * change
            self.prev_alpha = now
        return self.prob.tolist()

    def pick(self, total_scores: Sequence[float]) -> List[int]:
        """The agreed layers: this step's top k, or (accumulate) the most credit since last sent.

        ``total_scores`` are the probabilities summed across ranks, identical everywhere, so
        the credit, and the choice, are identical on every rank too.
        """
        if not self.accumulate:
            return super().pick(total_scores)
        assert self.acc is not None
        total = sum(float(s) for s in total_scores)
        if total > 0.0:
            self.credit = [c + self.k * float(s) / total
                           for c, s in zip(self.credit, total_scores)]
        chosen = top_k(self.credit, self.k, self.acc.forced())
        for i in chosen:
            self.credit[i] = 0.0
        return chosen

    # The hypernetwork trains on this rank's own gradients; the credit, from scores summed
    # over the ranks, is the same everywhere.
    per_rank_state = ("net", "optimizer", "prev_alpha", "prob")

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "net": [p.detach().clone() for p in self.net_params],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "prev_alpha": None if self.prev_alpha is None else self.prev_alpha.clone(),
                "prob": self.prob.clone(), "credit": list(self.credit)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for p, v in zip(self.net_params, state["net"]):
                p.copy_(v)
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.prev_alpha = None if state["prev_alpha"] is None else state["prev_alpha"].clone()
        self.prob = state["prob"].clone()
        # A state saved before credit existed resumes with none earned.
        self.credit = list(state.get("credit", [0.0] * len(self.layers)))
