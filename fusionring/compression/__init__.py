"""Gradient compressors, one file per method, behind Horovod's ``Compression`` names."""
from __future__ import annotations

from .base import Compressor, Memory
from .fp16 import FP16Compressor
from .nm import AdaptiveSchedule, NMCompressor, StepSchedule
from .nm import nm as _nm
from .none import NoneCompressor


class Compression:
    """Optional gradient compression used by allreduce and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    # A factory, not a class: each call makes a compressor with its own residuals and masks.
    nm = staticmethod(_nm)


__all__ = ["Compression", "Compressor", "Memory", "NoneCompressor", "FP16Compressor",
           "NMCompressor", "StepSchedule", "AdaptiveSchedule"]
