"""Gradients and parameters as bytes: encoded with fusionring's compressors, decoded per message on arrival.

A push is one byte buffer (every tensor of every compressed payload, back to back) and a layout (per gradient: its
name, the compressor's context, and each payload part's dtype and shape). The server decodes each push on its own
with the sending worker's decoder, so per-rank payloads (per-rank N:M masks, say) need no agreement between workers
and need not be summable. Parameters travel back dense: one buffer of the shard's tensors in order.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from ..compression import ClusterCompressor, NMCompressor, describe
from ..compression.nm import nm as _nm

Layout = List[Tuple[str, Any, bool, List[Tuple[str, Tuple[int, ...]]]]]


def check_compressor(compression: Any) -> None:
    """ValueError for a compressor the parameter server cannot use: one whose payloads need agreement between
    ranks (a shared N:M mask is chosen from the ranks' common estimate, which a server never forms)."""
    if isinstance(compression, NMCompressor) and compression.shared_mask:
        raise ValueError("compression: Compression.nm(..., shared_mask=True) needs every rank to agree on the "
                         "mask, which a parameter server does not do; use Compression.nm(..., shared_mask=False) "
                         "(per-rank masks, decoded on arrival)")
    if not callable(getattr(compression, "compress", None)) or \
            not callable(getattr(compression, "decompress", None)):
        raise ValueError(f"compression: {compression!r} has no compress()/decompress()")


def decoder_spec(compression: Any) -> bytes:
    """What a server needs to decode this worker's pushes, as bytes: the compressor's configuration for N:M
    (its state, residuals, stays with the worker), else the compressor itself (a class or a plain object)."""
    if isinstance(compression, NMCompressor):
        return pickle.dumps(("nm", {"n": compression.n, "m": compression.m, "values": compression.values}))
    if isinstance(compression, ClusterCompressor):  # the codebook travels in each payload; residuals stay
        return pickle.dumps(("cluster", {"k": compression.k, "sample": compression.sample,
                                         "buckets": compression.buckets, "values": compression.values,
                                         "seed": compression.seed}))
    return pickle.dumps(("object", compression))


def build_decoder(spec: bytes) -> Any:
    """The server's decoder from ``decoder_spec``'s bytes."""
    kind, value = pickle.loads(spec)
    if kind == "nm":
        return _nm(value["n"], value["m"], value["values"], shared_mask=False, error_feedback=False)
    if kind == "cluster":
        return ClusterCompressor(error_feedback=False, **value)
    return value


def _compress(compression: Any, name: str, tensor: torch.Tensor) -> Tuple[Any, Any]:
    if isinstance(compression, (NMCompressor, ClusterCompressor)):
        return compression.compress(tensor, name=name)  # its residuals are kept per gradient name
    return compression.compress(tensor)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


def encode(compression: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[Layout, np.ndarray]:
    """Compress each (name, gradient); return the layout and one uint8 buffer holding every payload part."""
    layout: Layout = []
    parts: List[np.ndarray] = []
    for name, tensor in named:
        payload, ctx = _compress(compression, name, tensor)
        is_tuple = isinstance(payload, (tuple, list))
        pieces = list(payload) if is_tuple else [payload]
        if not all(isinstance(p, torch.Tensor) for p in pieces):
            raise ValueError(f"compression: {describe(compression)} returned a payload that is not tensors "
                             f"for {name!r}")
        layout.append((name, ctx, is_tuple, [(str(p.dtype), tuple(p.shape)) for p in pieces]))
        parts.extend(_as_bytes(p) for p in pieces)
    buffer = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    return layout, buffer


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def copy_ok_to_skip(buffer: np.ndarray) -> bool:
    """Whether tensors may be views into ``buffer`` (a writable buffer received for this message alone)."""
    return buffer.flags.writeable and buffer.flags.aligned


def _from_bytes(buffer: np.ndarray, offset: int, dtype: str, shape: Tuple[int, ...]) -> Tuple[torch.Tensor, int]:
    dt = _DTYPES[dtype]
    count = int(np.prod(shape)) if shape else 1
    nbytes = count * torch.empty((), dtype=dt).element_size()
    if offset + nbytes > buffer.size:
        raise ValueError(f"a buffer of {buffer.size} bytes ends before a {dtype} tensor of shape {list(shape)} "
                         f"at byte {offset}")
    raw = buffer[offset:offset + nbytes]
    size = torch.empty((), dtype=dt).element_size()
    if offset % size or not copy_ok_to_skip(buffer):
        raw = raw.copy()  # a view needs the element size's alignment (and a buffer nobody reuses)
    return torch.from_numpy(raw).view(dt).reshape(shape), offset + nbytes


def decode(decoder: Any, layout: Layout, buffer: np.ndarray) -> Dict[str, torch.Tensor]:
    """Rebuild each gradient of a push (``encode``'s layout and buffer) with the sender's decoder."""
    out: Dict[str, torch.Tensor] = {}
    offset = 0
    for name, ctx, is_tuple, pieces in layout:
        tensors = []
        for dtype, shape in pieces:
            t, offset = _from_bytes(buffer, offset, dtype, shape)
            tensors.append(t)
        payload = tuple(tensors) if is_tuple else tensors[0]
        out[name] = decoder.decompress(payload, ctx)
    if offset != buffer.size:
        raise ValueError(f"a push's buffer holds {buffer.size} bytes, its layout describes {offset}")
    return out


def pack(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Dense tensors back to back as one uint8 buffer (the parameters a server sends)."""
    parts = [_as_bytes(t) for t in tensors]
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def unpack_into(buffer: np.ndarray, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``pack``'s buffer back into ``tensors`` (same shapes and dtypes, in the same order)."""
    offset = 0
    for t in tensors:
        src, offset = _from_bytes(buffer, offset, str(t.dtype), tuple(t.shape))
        with torch.no_grad():
            t.copy_(src)
    if offset != buffer.size:
        raise ValueError(f"a parameter buffer holds {buffer.size} bytes, the model needs {offset}")


def packed_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The size of ``pack(tensors)``."""
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["check_compressor", "decoder_spec", "build_decoder", "encode", "decode", "pack", "unpack_into",
           "packed_bytes"]
