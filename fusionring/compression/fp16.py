"""fp16 compression: floating-point tensors travel as float16 (half the bytes)."""
from __future__ import annotations

import torch

from .base import Compressor, register_compressor


@register_compressor("fp16")
class FP16Compressor(Compressor):
    """Cast floating-point tensors to float16 for the wire and back afterwards."""

    name = "fp16"
    summable = True       # a sum of float16 values is summed on the ring like any tensor
    elementwise = True
    reduces_into = True

    @staticmethod
    def compress(tensor: torch.Tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            tensor = tensor.to(torch.float16)
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            tensor = tensor.to(ctx)
        return tensor

    # Forms that write into tensors the caller keeps (DistributedOptimizer's gradients and
    # wire buffers): a cast straight into place, with no new tensor per step.
    @staticmethod
    def compress_into(tensor: torch.Tensor, out: torch.Tensor):
        """compress() into `out`, a tensor that an earlier compress() of the same shape returned."""
        out.copy_(tensor)
        return tensor.dtype

    @staticmethod
    def decompress_into(tensor: torch.Tensor, ctx, out: torch.Tensor) -> None:
        """decompress() into `out`, the tensor that was compressed."""
        out.copy_(tensor)
