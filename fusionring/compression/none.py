"""No compression: the tensor travels as it is."""
from __future__ import annotations

from .base import Compressor, register_compressor


@register_compressor("none")
class NoneCompressor(Compressor):
    """Default compressor: does nothing."""

    name = "none"
    summable = True
    elementwise = True
    identity = True

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
