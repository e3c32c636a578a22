"""The names of Horovod's ``horovod.torch.compression`` module, for scripts that import it by
name; the compressors themselves live in :mod:`fusionring.compression`."""
from __future__ import annotations

from ..compression import Compression, Compressor
from ..compression.fp16 import FP16Compressor
from ..compression.none import NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
