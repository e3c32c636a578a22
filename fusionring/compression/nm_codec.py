"""N:M sparsification with per-rank masks as a codec of the compressed ring on tensors
(fusionring/runtime/compressed_ring.py): the tensor twin of the core's NmCodec.

A payload is the chunk's mask (one bit per element, 64-bit words) followed by its kept
values in the value dtype, padded to 8 bytes. CPU tensors use the C++ kernels, CUDA
tensors the GPU kernels (csrc/nm_sparse.cu): the same selection, the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from ..dtypes import VALUE_CODES
# The kernels run on the current stream: the NCCL transport's while the ring runs.
from .nm_kernels import _stream, check_nm, check_values

_FLOAT32 = VALUE_CODES[torch.float32]


class NmCodec:
    """Keep the n largest of every m values; the mask travels with them."""

    def __init__(self, n: int, m: int, values: torch.dtype = torch.float32) -> None:
        self.n, self.m = check_nm(n, m)
        self.values = check_values(values)
        self._code = VALUE_CODES[self.values]
        self._value_bytes = torch.empty(0, dtype=self.values).element_size()
        self.granule = self.m

    def payload_bytes(self, count: int) -> int:
        bytes_ = (_C.nm_mask_words(count) * 8
                  + _C.nm_kept_count(count, self.n, self.m) * self._value_bytes)
        return -(-bytes_ // 8) * 8

    def _parts(self, payload: torch.Tensor, count: int):
        words = _C.nm_mask_words(count)
        kept = _C.nm_kept_count(count, self.n, self.m)
        start = words * 8
        mask = payload[:start].view(torch.int64)
        values = payload[start:start + kept * self._value_bytes].view(self.values)
        return mask, values

    def encode(self, x: torch.Tensor, at: int, payload: torch.Tensor,
               residual: Optional[torch.Tensor]) -> None:
        count = x.numel()
        if count == 0:
            return
        mask, values = self._parts(payload, count)
        res = residual.data_ptr() if residual is not None else 0
        if x.is_cuda:
            _C.nm_compress_cuda(x.data_ptr(), count, self.n, self.m, values.data_ptr(),
                                self._code, mask.data_ptr(), res, _stream(x))
        else:
            _C.nm_compress(x.data_ptr(), _FLOAT32, count, self.n, self.m, values.data_ptr(),
                           self._code, mask.data_ptr(), res)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._scatter(payload, out, accumulate=False)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        self._scatter(payload, out, accumulate=True)

    def _scatter(self, payload: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        count = out.numel()
        if count == 0:
            return
        mask, values = self._parts(payload, count)
        if out.is_cuda:
            _C.nm_scatter_cuda(values.data_ptr(), self._code, mask.data_ptr(), count, self.n,
                               self.m, out.data_ptr(), accumulate, _stream(out))
        elif accumulate:
            _C.nm_scatter_add(values.data_ptr(), self._code, mask.data_ptr(), count,
                              out.data_ptr())
        else:
            _C.nm_scatter(values.data_ptr(), self._code, mask.data_ptr(), count, out.data_ptr(),
                          _FLOAT32)
