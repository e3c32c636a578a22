"""Gradients and parameters as bytes: encoded with fusionring's compressors, decoded per message on arrival.

A push is one byte buffer (every tensor of every compressed payload, back to back) and a layout (per gradient: its
name, the compressor's context, and each payload part's dtype and shape). The server decodes each push on its own
with the sending worker's decoder, so per-rank payloads (per-rank N:M masks, say) need no agreement between workers
and need not be summable. Parameters travel back dense: one buffer of the shard's tensors in order.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..compression import ClusterCompressor, NMCompressor, describe
from ..compression.base import compress_named
from ..compression.nm import nm as _nm
from ..dtypes import byte_view

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




def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return byte_view(t.detach().contiguous().cpu())


def encode(compression: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[Layout, np.ndarray]:
    """Compress each (name, gradient); return the layout and one uint8 buffer holding every payload part."""
    layout, parts = encode_parts(compression, named)
    return layout, np.concatenate(parts) if parts else np.empty(0, np.uint8)


def encode_parts(compression: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[Layout, List[np.ndarray]]:
    """As ``encode``, but each payload part stays its own uint8 array (a view of the tensor's memory when it is
    contiguous on the CPU: uncompressed gradients are sent without a copy)."""
    layout: Layout = []
    parts: List[np.ndarray] = []
    for name, tensor in named:
        payload, ctx = compress_named(compression, tensor, name)  # `named` ones: state per gradient
        is_tuple = isinstance(payload, (tuple, list))
        pieces = list(payload) if is_tuple else [payload]
        if not all(isinstance(p, torch.Tensor) for p in pieces):
            raise ValueError(f"compression: {describe(compression)} returned a payload that is not tensors "
                             f"for {name!r}")
        layout.append((name, ctx, is_tuple, [(str(p.dtype), tuple(p.shape)) for p in pieces]))
        parts.extend(_as_bytes(p) for p in pieces)
    return layout, parts


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def tensor_dtype(name: str) -> torch.dtype:
    """The dtype that ``str(dtype)`` names (a parameter's, a buffer's or a payload part's)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name} cannot travel to a parameter server")
    return _DTYPES[name]


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


# Parts below this size travel together (one small copy) so a model of many small tensors is not many messages;
# larger ones travel as their own message, straight from (and into) the tensors' memory.
SMALL_PART_BYTES = 64 * 1024


def runs(sizes: Sequence[int], small: int = SMALL_PART_BYTES) -> List[Tuple[int, int]]:
    """Group parts of ``sizes`` bytes into messages, as (first, end) index ranges: a large part alone, neighbouring
    small parts together up to ``small`` bytes. Both ends compute it from the same sizes, so it is not sent."""
    out: List[Tuple[int, int]] = []
    i = 0
    while i < len(sizes):
        if sizes[i] >= small:
            out.append((i, i + 1))
            i += 1
            continue
        j, total = i, 0
        while j < len(sizes) and sizes[j] < small and total + sizes[j] <= small:
            total += sizes[j]
            j += 1
        out.append((i, j))
        i = j
    return out


def part_sizes(layout: Layout) -> List[int]:
    """The byte size of each payload part a layout describes, in order."""
    sizes = []
    for _, _, _, pieces in layout:
        for dtype, shape in pieces:
            count = int(np.prod(shape)) if shape else 1
            sizes.append(count * torch.empty((), dtype=_DTYPES[dtype]).element_size())
    return sizes


def send_parts(comm: Any, parts: Sequence[np.ndarray], dest: int, tag: int,
               copied: Optional[List[Any]] = None) -> List[Any]:
    """Isend ``parts`` as ``runs`` groups them; returns the requests that read a part's own memory (it must stay
    untouched until they are done). Grouped small parts travel as a copy: their requests go to ``copied`` when
    it is given (the caller need not wait for them before changing the parts), else they are returned too."""
    requests = []
    for a, b in runs([p.size for p in parts]):
        if b - a == 1:
            requests.append(comm.Isend(parts[a], dest=dest, tag=tag))
        else:  # mpi4py's request keeps the copy alive until the send is done
            request = comm.Isend(np.concatenate(parts[a:b]), dest=dest, tag=tag)
            (requests if copied is None else copied).append(request)
    return requests


def recv_parts(comm: Any, buffer: np.ndarray, sizes: Sequence[int], source: int, tag: int) -> None:
    """Receive ``send_parts``'s messages into one buffer, back to back."""
    offset = 0
    for a, b in runs(sizes):
        nbytes = sum(sizes[a:b])
        comm.Recv(buffer[offset:offset + nbytes], source=source, tag=tag)
        offset += nbytes


def recv_into(comm: Any, tensors: Sequence[torch.Tensor], source: int, tag: int) -> int:
    """Receive ``send_parts``'s messages of dense tensors straight into ``tensors`` (contiguous, on the CPU);
    returns the bytes received."""
    views = [_writable_bytes(t) for t in tensors]
    total = 0
    for a, b in runs([v.size for v in views]):
        if b - a == 1:
            comm.Recv(views[a], source=source, tag=tag)
        else:
            message = np.empty(sum(v.size for v in views[a:b]), np.uint8)
            comm.Recv(message, source=source, tag=tag)
            offset = 0
            for v in views[a:b]:
                v[...] = message[offset:offset + v.size]
                offset += v.size
        total += sum(v.size for v in views[a:b])
    return total


def _writable_bytes(t: torch.Tensor) -> np.ndarray:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("parameters must be contiguous CPU tensors to receive into")
    return byte_view(t.detach())


def dense_parts(tensors: Sequence[torch.Tensor]) -> List[np.ndarray]:
    """Each tensor's bytes as a uint8 view (the parameters a server sends, without packing them)."""
    return [_as_bytes(t) for t in tensors]


def packed_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The size of ``pack(tensors)``."""
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["check_compressor", "decoder_spec", "build_decoder", "encode", "encode_parts", "decode", "pack",
           "unpack_into", "runs", "part_sizes", "send_parts", "recv_parts", "recv_into", "dense_parts",
           "packed_bytes", "tensor_dtype"]
