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

_RUN_VALUES = 1 << 24


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
        if x.is_cuda or self.on_device:
            return self._each_run(x.numel(), lambda first, rows, length, wire, size: (
                cluster_kernels.encode_blocks(
                    x[first:first + rows * length].view(rows, length), self.k, self.sample,
                    self.buckets, self.values,
                    [_C.cluster_stream(self.seed, self.step, at + first + r * length)
                     for r in range(rows)],
                    payload[wire:wire + rows * size].view(rows, size),
                    None if residual is None
                    else residual[first:first + rows * length].view(rows, length))))
        for first, length, wire, size in self._blocks(x.numel()):
            res = residual[first:first + length] if residual is not None else None
            _C.cluster_encode(x[first:].data_ptr(), length, self.k, self.sample, self.buckets,
                              self._code, _C.cluster_stream(self.seed, self.step, at + first),
                              payload[wire:].data_ptr(), res.data_ptr() if res is not None else 0)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=False)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=True)

    def _decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool) -> None:
        if out.is_cuda or self.on_device:
            return self._each_run(out.numel(), lambda first, rows, length, wire, size: (
                cluster_kernels.decode_blocks(
                    payload[wire:wire + rows * size].view(rows, size), self.k, self.buckets,
                    self.values, out[first:first + rows * length].view(rows, length), add)))
        for first, length, wire, size in self._blocks(out.numel()):
            _C.cluster_decode(payload[wire:].data_ptr(), length, self.k, self.sample,
                              self.buckets, self._code, out[first:].data_ptr(), add)

    def _each_run(self, count: int, work) -> None:
        """work(first value, rows, values a row, first byte, bytes a row) over runs of equal
        blocks: the torch kernels take a run's blocks as the rows of one batch, at most
        _RUN_VALUES values at once (their temporaries take several bytes a value)."""
        full, tail = divmod(count, self.segment)
        size = self._block_bytes(self.segment)
        per_run = max(1, _RUN_VALUES // self.segment)
        for start in range(0, full, per_run):
            rows = min(per_run, full - start)
            work(start * self.segment, rows, self.segment, start * size, size)
        if tail:
            work(full * self.segment, 1, tail, full * size, self._block_bytes(tail))
