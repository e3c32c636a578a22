"""Gradient compressors, one file per method, behind Horovod's ``Compression`` names."""
from __future__ import annotations

from .base import Compressor, Memory
from .fp16 import FP16Compressor
from .none import NoneCompressor


class Compression:
    """Optional gradient compression used by allreduce and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "Memory", "NoneCompressor", "FP16Compressor"]
