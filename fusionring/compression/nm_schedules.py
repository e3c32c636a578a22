"""How an N:M compressor's level changes over training: fixed stages by step, or adapted to
how much the residuals hold back."""
from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from .nm_kernels import check_nm


class StepSchedule:
    """(n, m) by training step: ``[(0, (4, 4)), (100, (2, 4)), (1000, (1, 4))]``.

    At step k the last stage whose start is <= k applies; before the first stage, `initial`.
    """

    def __init__(self, stages: Sequence[Tuple[int, Tuple[int, int]]],
                 initial: Tuple[int, int]) -> None:
        parsed = []
        for stage in stages:
            try:
                start, (n, m) = stage
            except (TypeError, ValueError):
                raise ValueError(f"schedule stage {stage!r} must be (step, (n, m))") from None
            if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
                raise ValueError(f"schedule step {start!r} must be a non-negative int")
            try:
                parsed.append((int(start), check_nm(n, m)))
            except ValueError as exc:
                raise ValueError(f"schedule stage {stage!r}: {exc}") from None
        if not parsed:
            raise ValueError("a schedule needs at least one (step, (n, m)) stage")
        starts = [s for s, _ in parsed]
        if starts != sorted(set(starts)):
            raise ValueError(f"schedule steps must increase strictly, got {starts}")
        self.stages = parsed
        self.initial = check_nm(*initial)

    def at(self, step: int) -> Tuple[int, int]:
        level = self.initial
        for start, nm in self.stages:
            if start <= step:
                level = nm
        return level

    def describe(self) -> list:
        return [[s, list(nm)] for s, nm in self.stages]


# Default (low, high) ratio thresholds of schedule="adaptive". Measured on the digits MLP with
# error feedback, the held-back ratio sits near 0.1 at 2:4 and 0.3 at 1:4 with per-rank masks,
# and near 0.75-0.9 with a shared mask (which delays a position's values until its turn).
ADAPTIVE_THRESHOLDS = {"per-rank": dict(low=0.15, high=0.45),
                       "shared": dict(low=0.7, high=0.95)}


class AdaptiveSchedule:
    """Moves each tensor between sparsity levels by the size of what error feedback holds back.

    After every reduction of a tensor, ratio = sum over ranks |residual|^2 / sum over ranks
    |compensated gradient|^2 (one small allreduce, so every rank sees the same number) is
    smoothed: ema = smoothing * ema + (1 - smoothing) * ratio, restarted at each level change.
    Once `patience` reductions have passed at a level: ema > `high` moves one level denser,
    ema < `low` one level sparser. Levels run from dense (m:m) to the sparsest (n:m), halving
    n: n=1, m=4 gives 4:4 -> 2:4 -> 1:4. Every tensor starts dense. ``schedule="adaptive"``
    takes `low` and `high` from ADAPTIVE_THRESHOLDS for its mask mode.
    """

    def __init__(self, levels: Sequence[Tuple[int, int]], low: float = 0.3, high: float = 0.6,
                 smoothing: float = 0.8, patience: int = 20) -> None:
        self.levels = [check_nm(n, m) for n, m in levels]
        if not self.levels:
            raise ValueError("an adaptive schedule needs at least one (n, m) level")
        if not 0.0 <= low < high:
            raise ValueError(f"adaptive thresholds need 0 <= low < high, got {low}, {high}")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"adaptive smoothing must be in [0, 1), got {smoothing}")
        self.low, self.high, self.smoothing, self.patience = (float(low), float(high),
                                                              float(smoothing), int(patience))

    @classmethod
    def halving(cls, n: int, m: int, **kwargs) -> "AdaptiveSchedule":
        levels, k = [], m
        while k > n:
            levels.append((k, m))
            k //= 2
        levels.append((n, m))
        return cls(levels, **kwargs)

    def observe(self, state: Any, ratio: float) -> None:
        state.ema = ratio if state.ema is None else (self.smoothing * state.ema
                                                     + (1.0 - self.smoothing) * ratio)
        state.since += 1
        if state.since < self.patience:
            return
        if state.ema > self.high and state.level > 0:
            state.level, state.ema, state.since = state.level - 1, None, 0
        elif state.ema < self.low and state.level < len(self.levels) - 1:
            state.level, state.ema, state.since = state.level + 1, None, 0

    def describe(self) -> dict:
        return {"levels": [list(nm) for nm in self.levels], "low": self.low, "high": self.high,
                "smoothing": self.smoothing, "patience": self.patience}
