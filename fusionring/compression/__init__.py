"""Gradient compressors, one file per method, behind Horovod's ``Compression`` names.

Each method's file registers itself (``register_compressor``); importing it here makes it
``Compression.<name>``. The protocol a method implements is in :mod:`.base`.
"""
from __future__ import annotations

from .base import (Capabilities, Compression, Compressor, Memory, capabilities, describe,
                   lookup_compressor, register_compressor, registered_compressors,
                   resolve_compressor)
from .cluster import ClusterCompressor
from .fp16 import FP16Compressor
from .nm import AdaptiveSchedule, NMCompressor, StepSchedule
from .none import NoneCompressor

__all__ = ["Compression", "Compressor", "Memory", "Capabilities", "capabilities", "describe",
           "register_compressor", "registered_compressors", "lookup_compressor", "resolve_compressor",
           "NoneCompressor", "FP16Compressor", "ClusterCompressor", "NMCompressor", "StepSchedule", "AdaptiveSchedule"]
