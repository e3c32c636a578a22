"""Cluster-and-hash quantization as a codec of the compressed ring on tensors
(fusionring/runtime/compressed_ring.py): the tensor twin of the core's ClusterCodec.

A chunk travels as the core's ring sends it: blocks of at most `segment` values from the
chunk's start, each block one payload (csrc/cluster_quant.h) sampled from its own stream
(seed, step, where the block begins), the payloads back to back. CPU tensors use the C++
kernels, CUDA tensors the torch kernels of cluster_kernels.py: the same rules and layout.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from .. import _C
from ..dtypes import VALUE_CODES
from . import cluster_kernels


class ClusterCodec:
    """One reduction's codec: `step` is the compressor's position, `segment` the block size
    in values; `on_device` runs the torch kernels on CPU tensors too (they always run on
    CUDA tensors)."""

    granule = 1

    def __init__(self, k: int, sample: int, buckets: int, values: torch.dtype, seed: int,
                 step: int, segment: int, on_device: bool = False) -> None:
        self.k, self.sample, self.buckets, self.values = k, sample, buckets, values
        self.seed, self.step = seed, step
        self.segment = max(1, int(segment))
        self.on_device = on_device
        self._code = VALUE_CODES[values]

    def _block_bytes(self, count: int) -> int:
        return _C.cluster_payload_bytes(count, self.k, self.sample, self.buckets, self._code)

    def _blocks(self, count: int) -> Iterator[Tuple[int, int, int, int]]:
        """(first value, values, first byte, bytes) of each block of a chunk of `count`."""
        wire = 0
        for first in range(0, count, self.segment):
            length = min(self.segment, count - first)
            size = self._block_bytes(length)
            yield first, length, wire, size
            wire += size

    def payload_bytes(self, count: int) -> int:
        return sum(size for _, _, _, size in self._blocks(count))

    def encode(self, x: torch.Tensor, at: int, payload: torch.Tensor,
               residual: Optional[torch.Tensor]) -> None:
        for first, length, wire, size in self._blocks(x.numel()):
            block = x[first:first + length]
            out = payload[wire:wire + size]
            res = residual[first:first + length] if residual is not None else None
            stream = _C.cluster_stream(self.seed, self.step, at + first)
            if block.is_cuda or self.on_device:
                cluster_kernels.encode(block, self.k, self.sample, self.buckets, self.values,
                                       stream, out, res)
            else:
                _C.cluster_encode(block.data_ptr(), length, self.k, self.sample, self.buckets,
                                  self._code, stream, out.data_ptr(),
                                  res.data_ptr() if res is not None else 0)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=False)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=True)

    def _decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool) -> None:
        for first, length, wire, size in self._blocks(out.numel()):
            block = out[first:first + length]
            image = payload[wire:wire + size]
            if block.is_cuda or self.on_device:
                cluster_kernels.decode(image, self.k, self.buckets, self.values, block, add)
            else:
                _C.cluster_decode(image.data_ptr(), length, self.k, self.sample, self.buckets,
                                  self._code, block.data_ptr(), add)
