"""The selector base: knows the layers once attached, scores them, keeps what was not sent."""
from __future__ import annotations

import operator
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .base import Accumulator, how_many, layers_of, top_k


def integer(value) -> Optional[int]:
    """`value` as an int, or None when it is no integer (a bool, a float, a string)."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def _count(value) -> int:
    """`value` as an int, or -1 when it is no integer."""
    number = integer(value)
    return -1 if number is None else number


class LayerSelector:
    """Chooses k whole layers per step; subclasses say how a layer is scored.

    The layers come from ``model`` when given, else from the optimizer's ``named_parameters``
    when the selection is attached to it, so both ``hyper(model, ...)`` and ``norm(fraction)``
    work.

    ``warmup_steps``: for that many first steps every layer travels (the selection still scores
    them, so a hypernetwork trains from the start). Sparse updates with error feedback are
    most fragile at the start of training, when gradients are largest and a layer's
    kept-back sum can move it furthest at once; a short dense warm-up is the usual remedy.
    """

    def __init__(self, fraction: Optional[float] = None, k: Optional[int] = None,
                 max_wait: Optional[int] = None, model: Optional[torch.nn.Module] = None,
                 warmup_steps: int = 0) -> None:
        # Everything that does not depend on the model is checked here, when it is built.
        if (fraction is None) == (k is None):
            raise ValueError(f"layer_selection: give exactly one of fraction= or k= (got "
                             f"fraction={fraction!r}, k={k!r})")
        if fraction is not None and (isinstance(fraction, (str, bytes, bool))
                                     or not 0.0 < float(fraction) <= 1.0):
            raise ValueError(f"layer_selection: fraction={fraction!r} must be a number in (0, 1]")
        if k is not None and _count(k) < 1:
            raise ValueError(f"layer_selection: k={k!r} must be an integer >= 1")
        if max_wait is not None and _count(max_wait) < 1:
            raise ValueError(f"layer_selection: max_wait={max_wait!r} must be an integer >= 1 "
                             f"or None")
        steps = _count(warmup_steps)
        if steps < 0:
            raise ValueError(f"layer_selection: warmup_steps={warmup_steps!r} must be an integer >= 0")
        self.fraction, self.k_arg, self.max_wait = fraction, k, max_wait
        self.warmup_steps = steps
        self.layers: List[List[str]] = []
        self.params: Dict[str, torch.Tensor] = {}
        self.k = 0
        self.step_count = 0
        self.acc: Optional[Accumulator] = None
        if model is not None:
            self.attach(model.named_parameters())

    def attach(self, named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Learn the layers; a second call (the optimizer's) must update exactly these parameters.

        Parameters are matched by identity, not name: the optimizer may name them otherwise
        (``param.0.3`` without ``named_parameters``), and the selection keeps its own names.
        """
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if self.layers:
            theirs = {id(p) for _, p in named}
            mine = {id(p) for p in self.params.values()}
            missing = [n for n, p in self.params.items() if id(p) not in theirs]
            if missing:
                raise ValueError(f"layer_selection: parameters {missing[:3]} are not owned by "
                                 f"the optimizer")
            unknown = [n for n, p in named if id(p) not in mine]
            if unknown:
                raise ValueError(f"layer_selection: the optimizer updates parameters "
                                 f"{unknown[:3]} that the selection's model does not have")
            return
        self.layers = layers_of(named)
        self.params = dict(named)
        self.k = how_many(len(self.layers), self.fraction if self.k_arg is None else None, self.k_arg)
        self.acc = Accumulator(len(self.layers), self.max_wait)
        self._attached()

    def names(self) -> Dict[int, str]:
        """id(parameter) -> the selection's name for it."""
        return {id(p): n for n, p in self.params.items()}

    def _attached(self) -> None:
        """Hook for subclasses that build state per layer."""

    def scores(self, summed: Dict[str, torch.Tensor]) -> List[float]:
        """This rank's score per layer for this step (higher is sent first)."""
        raise NotImplementedError

    def choose(self, total_scores: Sequence[float]) -> List[int]:
        """The agreed layers from the scores summed across ranks: all of them while warming up."""
        assert self.acc is not None
        if self.step_count < self.warmup_steps:
            return list(range(len(self.layers)))
        return self.pick(total_scores)

    def pick(self, total_scores: Sequence[float]) -> List[int]:
        """The policy's k layers from the summed scores (the k highest, ``max_wait`` ones first)."""
        assert self.acc is not None
        return top_k(total_scores, self.k, self.acc.forced())

    # Entries of state_dict() that each rank computes from its own gradients (beside the
    # accumulator's residual): a rank loading another rank's state keeps its own.
    per_rank_state: tuple = ()

    def state_dict(self) -> dict:
        assert self.acc is not None
        return {"step": self.step_count, "acc": self.acc.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        assert self.acc is not None
        self.step_count = state["step"]
        self.acc.load_state_dict(state["acc"])
