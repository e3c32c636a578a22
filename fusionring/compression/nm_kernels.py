"""The N:M kernels on tensors: validation, selection, gather and scatter of kept values,
masks (the C++ kernels of ``csrc/nm_sparse.*``, on CPU or CUDA tensors)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

import torch

from .. import _C
from ..dtypes import DTYPE_CODES, VALUE_CODES


def _squares(t: torch.Tensor) -> float:
    """Sum of squares in double: one pass in the core for CPU tensors, no double copy."""
    if t.device.type == "cpu" and t.is_contiguous() and t.dtype in DTYPE_CODES:
        return _C.sum_squares(t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype])
    return float(t.double().square().sum())


MAX_M = 32


# ---------------------------------------------------------------------- validation
def check_nm(n: Any, m: Any) -> Tuple[int, int]:
    """Return (n, m) as ints; ValueError naming the bad one unless 1 <= n <= m <= 32."""
    for label, value in (("n", n), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"N:M {label} must be an int, not {value!r}")
    n, m = int(n), int(m)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"N:M m={m} must be in [1, {MAX_M}]")
    if not 1 <= n <= m:
        raise ValueError(f"N:M n={n} must be in [1, m={m}]")
    return n, m


def check_values(values: Any) -> torch.dtype:
    """The value dtype, or ValueError naming it unless float32/float16/bfloat16."""
    if isinstance(values, str):
        values = getattr(torch, values, values)
    if values not in VALUE_CODES:
        raise ValueError(f"N:M values dtype {values!r} must be torch.float32, torch.float16 "
                         f"or torch.bfloat16")
    return values


def bits_per_element(n: int, m: int, values: torch.dtype = torch.float32,
                     shared_mask: bool = False) -> float:
    """Wire bits per original element: N/M values, plus one mask bit unless the mask is shared.

    Dense (n == m) sends the values only. 2:4 float32: 17 (16 shared); float16: 9 (8 shared).
    """
    n, m = check_nm(n, m)
    value_bits = 8 * torch.empty(0, dtype=check_values(values)).element_size()
    if n == m:
        return float(value_bits)
    return n / m * value_bits + (0.0 if shared_mask else 1.0)


# ---------------------------------------------------------------------- kernels on tensors
def _flat_f32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in VALUE_CODES:
        raise ValueError(f"N:M input dtype {tensor.dtype} must be float32, float16 or bfloat16")
    return tensor.detach().reshape(-1).contiguous()


def cuda_kernels(tensor: torch.Tensor, m: int) -> bool:
    """Whether `tensor` can use the GPU kernels (built with CUDA, m dividing 32)."""
    return tensor.is_cuda and bool(getattr(_C, "nm_cuda_built", False)) and 32 % m == 0


def _stream(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _require_cuda(tensor: torch.Tensor, m: int) -> None:
    if not cuda_kernels(tensor, m):
        raise ValueError(f"N:M on a {tensor.device} tensor needs fusionring built with CUDA "
                         f"and m dividing 32 (m={m}); move the tensor to the CPU")


def compress_values(x: torch.Tensor, n: int, m: int, values: torch.dtype = torch.float32,
                    residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Select n of every m of `x` -> (kept values in `values` dtype, int64 mask words).

    `residual` (float32, numel of x) receives x - unpack(values) when given. CPU tensors use
    the C++ kernels, CUDA tensors the GPU kernels (the same bits).
    """
    n, m = check_nm(n, m)
    code = VALUE_CODES[check_values(values)]
    flat = _flat_f32(x)
    count = flat.numel()
    kept = torch.empty(_C.nm_kept_count(count, n, m), dtype=values, device=flat.device)
    mask = torch.empty(_C.nm_mask_words(count), dtype=torch.int64, device=flat.device)
    if flat.is_cuda:
        _require_cuda(flat, m)
        flat = flat.float()
        _C.nm_compress_cuda(flat.data_ptr(), count, n, m, kept.data_ptr(), code, mask.data_ptr(),
                            _residual_ptr(residual, count), _stream(flat))
        return kept, mask
    _C.nm_compress(flat.data_ptr(), VALUE_CODES[flat.dtype], count, n, m, kept.data_ptr(), code,
                   mask.data_ptr(), _residual_ptr(residual, count))
    return kept, mask


def select_mask(x: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The N:M mask of `x` as int64 words (bit i = element i kept)."""
    n, m = check_nm(n, m)
    flat = _flat_f32(x)
    mask = torch.empty(_C.nm_mask_words(flat.numel()), dtype=torch.int64, device=flat.device)
    if flat.is_cuda:
        _require_cuda(flat, m)
        flat = flat.float()
        _C.nm_compress_cuda(flat.data_ptr(), flat.numel(), n, m, 0, 0, mask.data_ptr(), 0,
                            _stream(flat))
        return mask
    _C.nm_select_mask(flat.data_ptr(), VALUE_CODES[flat.dtype], flat.numel(), n, m,
                      mask.data_ptr())
    return mask


def gather(x: torch.Tensor, mask: torch.Tensor, values: torch.dtype = torch.float32,
           residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
           nm: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Pack the elements of `x` whose mask bit is set (select with a given mask).

    On CUDA tensors the mask must come from N:M selection and `nm` name its (n, m).
    """
    code = VALUE_CODES[check_values(values)]
    flat = _flat_f32(x)
    count = flat.numel()
    _check_mask(mask, count)
    if flat.is_cuda:
        if nm is None:
            raise ValueError("gather on a CUDA tensor needs nm=(n, m) of the mask")
        n, m = check_nm(*nm)
        _require_cuda(flat, m)
        kept = _C.nm_kept_count(count, n, m)
    else:
        kept = _C.nm_mask_popcount(mask.data_ptr(), count)
    if out is None:
        out = torch.empty(kept, dtype=values, device=flat.device)
    elif out.numel() != kept or out.dtype != values or not out.is_contiguous():
        raise ValueError(f"gather output must be {kept} contiguous {values} values")
    if flat.is_cuda:
        _C.nm_gather_cuda(flat.float().data_ptr(), count, n, m, mask.data_ptr(), out.data_ptr(),
                          code, _residual_ptr(residual, count), _stream(flat))
        return out
    _C.nm_gather(flat.data_ptr(), VALUE_CODES[flat.dtype], count, mask.data_ptr(),
                 out.data_ptr(), code, _residual_ptr(residual, count))
    return out


def scatter(kept: torch.Tensor, mask: torch.Tensor, count: int,
            out: Optional[torch.Tensor] = None, accumulate: bool = False,
            nm: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Put `kept` back at the masked positions of a float32 vector of `count` (zeros elsewhere,
    or added into `out` with accumulate=True). On CUDA, `nm` names the mask's (n, m)."""
    _check_mask(mask, count)
    if kept.dtype not in VALUE_CODES or not kept.is_contiguous():
        raise ValueError("N:M values must be a contiguous float32/float16/bfloat16 tensor")
    if kept.is_cuda:
        if nm is None:
            raise ValueError("scatter on a CUDA tensor needs nm=(n, m) of the mask")
        n, m = check_nm(*nm)
        _require_cuda(kept, m)
        expected = _C.nm_kept_count(count, n, m)
    else:
        expected = _C.nm_mask_popcount(mask.data_ptr(), count)
    if kept.numel() != expected:
        raise ValueError(f"the mask selects {expected} values but {kept.numel()} were given")
    if out is None:
        out = torch.zeros(count, device=kept.device) if accumulate else torch.empty(
            count, device=kept.device)
    if out.dtype != torch.float32 or out.numel() != count or not out.is_contiguous():
        raise ValueError(f"N:M output must be a contiguous float32 tensor of {count} elements")
    if kept.is_cuda:
        _C.nm_scatter_cuda(kept.data_ptr(), VALUE_CODES[kept.dtype], mask.data_ptr(), count, n, m,
                           out.data_ptr(), accumulate, _stream(kept))
    elif accumulate:
        _C.nm_scatter_add(kept.data_ptr(), VALUE_CODES[kept.dtype], mask.data_ptr(), count,
                          out.data_ptr())
    else:
        _C.nm_scatter(kept.data_ptr(), VALUE_CODES[kept.dtype], mask.data_ptr(), count,
                      out.data_ptr(), 0)
    return out


def mask_to_bool(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Unpack int64 mask words into a bool tensor of `count` elements (on the mask's device)."""
    octets = mask.reshape(-1).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=octets.device)
    return ((octets.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:count].bool()


def _check_mask(mask: torch.Tensor, count: int) -> None:
    words = _C.nm_mask_words(count)
    if mask.dtype != torch.int64 or mask.numel() != words or not mask.is_contiguous():
        raise ValueError(f"an N:M mask of {count} elements is {words} contiguous int64 words")


def _residual_ptr(residual: Optional[torch.Tensor], count: int) -> int:
    if residual is None:
        return 0
    if residual.dtype != torch.float32 or residual.numel() != count or not residual.is_contiguous():
        raise ValueError(f"the residual must be a contiguous float32 tensor of {count} elements")
    return residual.data_ptr()
