"""torch <-> core dtype tables and the views the core reads tensors through.

A leaf: it imports torch and nothing of fusionring, so the runtime, the compressors and the
framework face can all use it without importing each other.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional

import torch

# torch dtype -> the core's DType code (csrc/dtype.h).
DTYPE_CODES: Dict[torch.dtype, int] = {
    torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3,
    torch.int32: 4, torch.int64: 5, torch.uint8: 6, torch.int8: 7, torch.int16: 8,
}

# The floating-point dtypes a compressed payload's values may take (a subset of DTYPE_CODES).
VALUE_CODES: Dict[torch.dtype, int] = {d: DTYPE_CODES[d]
                                       for d in (torch.float32, torch.float16, torch.bfloat16)}

# Complex tensors are reduced as their real and imaginary parts (torch.view_as_real): a sum
# or an average of complex numbers is the sum or average of each part.
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


@functools.lru_cache(maxsize=None)
def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name specs and messages use."""
    return str(dtype).replace("torch.", "")


def check_dtype(tensor: torch.Tensor, name: str) -> None:
    """Raise ValueError naming the tensor and dtype when the core cannot reduce it."""
    if tensor.dtype not in DTYPE_CODES and tensor.dtype not in COMPLEX_DTYPES:
        supported = ", ".join(dtype_name(d) for d in (*DTYPE_CODES, *COMPLEX_DTYPES))
        raise ValueError(f"tensor '{name}' has unsupported dtype {dtype_name(tensor.dtype)}; "
                         f"fusionring supports {supported}")


def real_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor the core reduces: a complex tensor's parts as a real one (same memory)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def complex_result(spec, output: torch.Tensor) -> torch.Tensor:
    """A reduction's output in the dtype its caller gave (undoes `real_view`); `spec` is the
    request's TensorSpec (only its dtype name is read)."""
    if spec.dtype.startswith("complex") and not output.is_complex():
        return torch.view_as_complex(output)
    return output


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's memory (any dtype, any device)."""
    flat = tensor.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a tensor of at most one element contiguous whatever its stride (an
        # empty one from numpy has stride 0), but will not view it as bytes then.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def byte_view(tensor: torch.Tensor):
    """A writable numpy uint8 view of a contiguous CPU tensor's memory (any dtype)."""
    return flat_bytes(tensor).numpy()


def contiguous_view(tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat tensor over `tensors` when they lie back to back, in order, in one storage
    (so a reduction needs no pack or unpack); else None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for tensor in tensors:
        if (tensor.dtype != first.dtype or tensor.data_ptr() != end or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != storage):
            return None
        end += tensor.numel() * tensor.element_size()
    numel = sum(t.numel() for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,))
