"""Straggler emulation (``fusionrun --slow RANK:FACTOR``, ``FUSIONRING_SLOWDOWN``): a rank whose
compute takes `factor` times as long as it does."""
from __future__ import annotations

import time
from typing import Optional

from .config import settings


class Straggler:
    """Stretches a rank's compute time per step by sleeping (factor - 1) times it.

    The sleep goes where a slower processor loses its time: before the step's first gradient is
    handed to communication (so the peers wait for it), or, when no gradient passes a hook (a
    parameter-server worker pushes in ``step()``), at the start of ``step()``.
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._mark = time.perf_counter()       # the end of the last step
        self._slept: Optional[float] = None    # this step's sleep so far (None: none yet)
        self._previous: Optional[float] = None  # the last step's compute time, unstretched

    @classmethod
    def from_settings(cls) -> Optional["Straggler"]:
        """One for this rank when ``FUSIONRING_SLOWDOWN`` is above 1, else None."""
        factor = settings().slowdown_factor
        return cls(factor) if factor > 1.0 else None

    def gradient_ready(self) -> None:
        """A gradient is about to be handed to communication: the step's first one waits."""
        if self._slept is not None:
            return
        # The whole step's compute is known only at step(): the last step's stands for it.
        compute = self._previous if self._previous is not None else time.perf_counter() - self._mark
        self._slept = (self.factor - 1.0) * compute
        time.sleep(self._slept)

    def step(self) -> None:
        """The step's gradients are computed: stretch what no hook stretched, and learn the
        step's compute time."""
        compute = time.perf_counter() - self._mark
        if self._slept is None:
            time.sleep((self.factor - 1.0) * compute)
        else:
            compute -= self._slept
        self._previous = compute

    def step_ended(self) -> None:
        self._mark = time.perf_counter()
        self._slept = None
