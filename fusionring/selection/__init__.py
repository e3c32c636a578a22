"""Layer selection policies: which whole layers' gradients travel each step (the rest wait)."""
from __future__ import annotations

from .base import Accumulator, how_many, layers_of, top_k

__all__ = ["Accumulator", "how_many", "layers_of", "top_k"]
