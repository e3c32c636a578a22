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

    def _runs(self, count: int, rows_at_most: int) -> Iterator[Tuple[int, int, int, int, int]]:
        """(first value, rows, values a row, first byte, bytes a row) of each run of at most
        `rows_at_most` equal blocks of a chunk of `count`; the tail block is a run of its own."""
        full, tail = divmod(count, self.segment)
        size = self._block_bytes(self.segment)
        for start in range(0, full, rows_at_most):
            yield (start * self.segment, min(rows_at_most, full - start), self.segment,
                   start * size, size)
        if tail:
            yield full * self.segment, 1, tail, full * size, self._block_bytes(tail)

    def _batches(self, count: int) -> Iterator[Tuple[int, int, int, int, int]]:
        """Runs for the torch kernels, which take a run's blocks as the rows of one batch, at
        most _RUN_VALUES values at once (their temporaries take several bytes a value)."""
        return self._runs(count, max(1, _RUN_VALUES // self.segment))

    def payload_bytes(self, count: int) -> int:
        return sum(rows * size for _, rows, _, _, size in self._runs(count, 1 << 62))

    def encode(self, x: torch.Tensor, at: int, payload: torch.Tensor,
               residual: Optional[torch.Tensor]) -> None:
        if x.is_cuda or self.on_device:
            for first, rows, length, wire, size in self._batches(x.numel()):
                end = first + rows * length
                cluster_kernels.encode_blocks(
                    x[first:end].view(rows, length), self.k, self.sample, self.buckets,
                    self.values,
                    [_C.cluster_stream(self.seed, self.step, at + first + r * length)
                     for r in range(rows)],
                    payload[wire:wire + rows * size].view(rows, size),
                    None if residual is None else residual[first:end].view(rows, length))
            return
        for first, _, length, wire, _ in self._runs(x.numel(), 1):
            res = residual[first:].data_ptr() if residual is not None else 0
            _C.cluster_encode(x[first:].data_ptr(), length, self.k, self.sample, self.buckets,
                              self._code, _C.cluster_stream(self.seed, self.step, at + first),
                              payload[wire:].data_ptr(), res)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=False)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._decode(payload, out, add=True)

    def _decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool) -> None:
        if out.is_cuda or self.on_device:
            for first, rows, length, wire, size in self._batches(out.numel()):
                cluster_kernels.decode_blocks(
                    payload[wire:wire + rows * size].view(rows, size), self.k, self.buckets,
                    self.values, out[first:first + rows * length].view(rows, length), add)
            return
        for first, _, length, wire, _ in self._runs(out.numel(), 1):
            _C.cluster_decode(payload[wire:].data_ptr(), length, self.k, self.sample,
                              self.buckets, self._code, out[first:].data_ptr(), add)
