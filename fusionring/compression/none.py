"""No compression: the tensor travels as it is."""
from __future__ import annotations

from .base import Compressor


class NoneCompressor(Compressor):
    """Default compressor: does nothing."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
