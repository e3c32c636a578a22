"""Cluster-and-hash quantization of one block in torch operations: the rules of
csrc/cluster_quant.h for blocks that lie on a GPU.

Every step runs where the block lies, with no host synchronization: data-dependent sizes stay
on the device (the sample keeps a fixed length, its non-finite values sorted to the end and
counted), and K-means always takes the full kClusterLloydSteps steps, as a converged step
changes nothing. The sample's indices, the hash and the payload's bit packing are integer
arithmetic and give the core's bits. On CPU tensors the whole payload is the core's, bit for
bit (tests/test_cluster_kernels.py). On a GPU two float64 sums run in another order (the
sample's prefix sums as a parallel scan, the buckets' sums with atomic adds), so a centre or
a bucket mean may differ from the core's in its last bit; every rank decodes the bytes that
were sent, so the ranks still agree.

Blocks of equal length are encoded together, one row each (``encode_blocks``): a chunk of the
compressed ring is a few dozen torch operations whatever its number of blocks, instead of that
many per block.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from .. import _C

# csrc/cluster_quant.h
LLOYD_STEPS = 32
ENTROPY_BINS = 8
LANES = 16          # the core's bucket sums: value i adds into lane i % 16, lanes in order
_GOLDEN64 = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_GOLDEN32 = 0x9E3779B1
_MASK32 = 0xFFFFFFFF


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores (products of int64 tensors wrap)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding 64-bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(state: torch.Tensor) -> torch.Tensor:
    """splitmix64's output for each (already advanced) state."""
    z = state
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the parts of a block's payload begin (csrc/cluster_quant.h)."""

    bits: int
    value_bytes: int
    nb_offset: int
    ids_offset: int
    id_bytes: int
    total: int


def layout(count: int, k: int, buckets: int, values: torch.dtype) -> Layout:
    bits = _C.cluster_id_bits(k)
    size = torch.empty(0, dtype=values).element_size()
    nb_offset = buckets * size
    ids_offset = nb_offset + 2 * k
    id_bytes = (count * bits + 7) // 8
    total = 0 if count == 0 else (ids_offset + id_bytes + 7) // 8 * 8
    return Layout(bits, size, nb_offset, ids_offset, id_bytes, total)


def _sample(x: torch.Tensor, sample: int, streams: torch.Tensor):
    """Each row's sorted sample, non-finite values last as +inf, and how many are finite
    (a device tensor per row)."""
    rows, count = x.shape
    if count <= sample:
        drawn = x
    else:
        if count >= 1 << 31:
            raise ValueError(f"Compression.cluster blocks on a GPU hold under 2**31 values, "
                             f"not {count}")
        n = torch.arange(1, sample + 1, dtype=torch.int64, device=x.device)
        r = _splitmix64(n * _signed(_GOLDEN64) + streams.unsqueeze(1))
        # index = (r * count) >> 64 on the unsigned draw r, from its 32-bit halves
        high, low = _shr(r, 32), r & _MASK32
        index = (high * count + _shr(low * count, 32)) >> 32
        drawn = torch.gather(x, 1, index)
    finite = torch.isfinite(drawn)
    s = torch.sort(torch.where(finite, drawn, torch.full_like(drawn, float("inf"))), 1).values
    return s, finite.sum(1)


def _bounds(centres: torch.Tensor) -> torch.Tensor:
    return (centres[:, :-1] + centres[:, 1:]) * 0.5


def _edges(s: torch.Tensor, bounds: torch.Tensor, first: torch.Tensor,
           last: torch.Tensor) -> torch.Tensor:
    """Where each cluster's run of each row's sorted sample (its finite part, `last` values)
    begins, and the end of the last: cluster j's run is [edges[j], edges[j + 1]), empty when
    the end falls before the start (boundaries out of order), as in the core. `first` is a
    column of zeros."""
    ends = torch.minimum(torch.searchsorted(s, bounds, right=True), last)
    return torch.cat([first, ends, last], 1)


def _sequential_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum in index order, as the core adds (a cumulative sum's last entry)."""
    return torch.cumsum(t, dim=dim).select(dim, -1)


def fit(x: torch.Tensor, k: int, sample: int, buckets: int, streams: torch.Tensor):
    """Per row of `x`: the K-means centres' boundaries, the buckets per cluster and each
    cluster's first bucket."""
    s, S = _sample(x, sample, streams)
    rows, width_ = s.shape
    device = x.device
    prefix = torch.cat([torch.zeros(rows, 1, dtype=torch.float64, device=device),
                        torch.cumsum(s.double(), 1)], 1)
    j = torch.arange(k, dtype=torch.int64, device=device)
    start = torch.clamp((2 * j + 1) * S.unsqueeze(1) // (2 * k), max=width_ - 1)
    picked = torch.gather(s, 1, start)
    centres = torch.where(S.unsqueeze(1) > 0, picked, torch.zeros_like(picked))
    # Lloyd's steps, in as few operations as the step allows (each is a launch on a GPU).
    first_edge = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    last_edge = S.unsqueeze(1)
    for _ in range(LLOYD_STEPS):
        edges = _edges(s, _bounds(centres), first_edge, last_edge)
        at = torch.gather(prefix, 1, edges)
        n = edges[:, 1:] - edges[:, :-1]
        centres = torch.where(n > 0, ((at[:, 1:] - at[:, :-1]) / n).float(), centres)
    bounds = _bounds(centres)
    edges = _edges(s, bounds, first_edge, last_edge)
    lo = edges[:, :-1].contiguous()  # searched below
    hi = torch.maximum(edges[:, 1:], lo)
    n = hi - lo

    # Scores: density x |centre| x entropy, each normalised by its row's maximum.
    density = torch.where(S.unsqueeze(1) > 0, n.double() / S.unsqueeze(1).double(),
                          torch.zeros_like(n, dtype=torch.float64))
    value = centres.double().abs()
    first = torch.gather(s, 1, torch.clamp(lo, max=width_ - 1)).double()
    last = torch.gather(s, 1, torch.clamp(hi - 1, min=0, max=width_ - 1)).double()
    spread = (n > 1) & (last != first)
    width = torch.where(spread, last - first, torch.ones_like(first))
    position = torch.arange(width_, dtype=torch.int64, device=device).expand(rows, width_)
    owner = torch.clamp(torch.searchsorted(lo, position.contiguous(), right=True) - 1, min=0)
    inside = ((position < S.unsqueeze(1)) & (position < torch.gather(hi, 1, owner))
              & torch.gather(spread, 1, owner))
    scaled = ((s.double() - torch.gather(first, 1, owner)) / torch.gather(width, 1, owner)
              * ENTROPY_BINS)
    scaled = torch.where(inside, scaled, torch.zeros_like(scaled))
    bin_ = torch.clamp(scaled.to(torch.int64), max=ENTROPY_BINS - 1)
    row = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1)
    bins = torch.zeros(rows * k * ENTROPY_BINS, dtype=torch.int64, device=device)
    bins.index_add_(0, ((row * k + owner) * ENTROPY_BINS + bin_).reshape(-1),
                    inside.to(torch.int64).reshape(-1))
    q = (bins.view(rows, k, ENTROPY_BINS).double()
         / torch.clamp(n, min=1).double().unsqueeze(2))
    terms = torch.where(q > 0, q * torch.log2(torch.where(q > 0, q, torch.ones_like(q))),
                        torch.zeros_like(q))
    entropy = -_sequential_sum(terms, 2)
    entropy = torch.where(spread, entropy, torch.zeros_like(entropy))
    factors = []
    for f in (density, value, entropy):
        top = torch.clamp(f.max(1, keepdim=True).values, min=0.0)
        factors.append(torch.where(top > 0, f / torch.where(top > 0, top, torch.ones_like(top)),
                                   torch.ones_like(f)))
    score = factors[0] * factors[1] * factors[2]
    total = _sequential_sum(score, 1).unsqueeze(1)

    # Buckets: one each, the rest in proportion to the scores by largest remainders.
    extra = buckets - k
    exact = extra * score / torch.where(total > 0, total, torch.ones_like(total))
    share = torch.where(total > 0, torch.floor(exact),
                        torch.full_like(exact, float(extra // k)))
    frac = torch.where(total > 0, exact - share, (j < extra % k).double().expand(rows, k))
    share = share.to(torch.int64)
    remaining = torch.clamp(extra - share.sum(1, keepdim=True), min=0)
    order = torch.sort(frac, dim=1, descending=True, stable=True).indices
    more = remaining // k + (j < remaining % k).to(torch.int64)  # the r-th goes to order[r % k]
    nb = (1 + share).scatter_add_(1, order, more)
    off = torch.cumsum(nb, 1) - nb
    return bounds, nb, off


def _cluster_ids(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """#{ j : boundary_j < x } per row, NaN in cluster 0."""
    ids = torch.searchsorted(bounds, x)
    return torch.where(torch.isnan(x), torch.zeros_like(ids), ids)


def _buckets(ids: torch.Tensor, nb: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    index = torch.arange(ids.shape[1], dtype=torch.int64, device=ids.device)
    h = (index * _GOLDEN32) & _MASK32
    return torch.gather(off, 1, ids) + (((h >> 16) * torch.gather(nb, 1, ids)) >> 16)


def _value_bits(means: torch.Tensor, values: torch.dtype) -> torch.Tensor:
    """The bucket means (rows of float32) as the payload stores them, as rows of bytes (the
    core's roundings)."""
    rows = means.shape[0]
    if values == torch.float32:
        return means.contiguous().view(torch.uint8).view(rows, -1)
    bits = means.view(torch.int32).to(torch.int64) & _MASK32
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if values == torch.bfloat16:
        word = _shr(bits + 0x7FFF + (_shr(bits, 16) & 1), 16)
        word = torch.where(nan, _shr(bits, 16) | 0x40, word)
    else:  # float16: torch rounds to nearest even, as the core does; NaN is made quiet
        word = means.half().view(torch.int16).to(torch.int64)
        word = torch.where(nan, (_shr(bits, 16) & 0x8000) | 0x7E00, word)
    word = word & 0xFFFF
    return torch.stack([word & 0xFF, word >> 8], 2).to(torch.uint8).reshape(rows, -1)


def _read_values(raw: torch.Tensor, values: torch.dtype) -> torch.Tensor:
    """Rows of stored means (bytes) as float32."""
    return raw.contiguous().view(values).float()


def _pack(ids: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """Each row's ids as a little-endian stream of `bits`-bit fields, `nbytes` per row."""
    rows, count = ids.shape
    if bits == 8:
        return ids.to(torch.uint8)
    shifts = torch.arange(bits, dtype=torch.uint8, device=ids.device)
    planes = ((ids.to(torch.uint8).unsqueeze(2) >> shifts) & 1).reshape(rows, -1)
    padded = torch.zeros(rows, nbytes * 8, dtype=torch.uint8, device=ids.device)
    padded[:, :count * bits] = planes
    weights = torch.arange(8, dtype=torch.uint8, device=ids.device)
    return (padded.view(rows, nbytes, 8) << weights).sum(2, dtype=torch.uint8)


def _unpack(raw: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    rows = raw.shape[0]
    if bits == 8:
        return raw[:, :count].to(torch.int64)
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    planes = ((raw.unsqueeze(2) >> shifts) & 1).reshape(rows, -1)[:, :count * bits]
    weights = torch.arange(bits, dtype=torch.int64, device=raw.device)
    return (planes.reshape(rows, count, bits).to(torch.int64) << weights).sum(2)


def encode_blocks(x: torch.Tensor, k: int, sample: int, buckets: int, values: torch.dtype,
                  streams: Sequence[int], payload: torch.Tensor,
                  residual: Optional[torch.Tensor]) -> None:
    """Encode each row of float32 `x` (rows of one length, row r sampled from streams[r])
    into the same row of uint8 `payload` (``layout(...).total`` bytes a row, rows 8-byte
    aligned); `residual`, when given, receives x - decode(payload) row by row."""
    rows, count = x.shape
    if count == 0 or rows == 0:
        return
    device = x.device
    shape = layout(count, k, buckets, values)
    stream = torch.tensor([_signed(v) for v in streams], dtype=torch.int64, device=device)
    bounds, nb, off = fit(x, k, sample, buckets, stream)
    ids = _cluster_ids(x, bounds.contiguous())
    bucket = _buckets(ids, nb, off)
    row = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(1)
    lane = torch.arange(count, dtype=torch.int64, device=device) % LANES
    sums = torch.zeros(rows * LANES * buckets, dtype=torch.float64, device=device)
    # In element order within each (row, lane, bucket), as the core adds (on the CPU).
    sums.index_add_(0, ((row * LANES + lane) * buckets + bucket).reshape(-1),
                    x.double().reshape(-1))
    total = _sequential_sum(sums.view(rows, LANES, buckets), 1)
    # Counted with index_add_: bincount sizes its result from the input's maximum, which a
    # GPU would have to send to the host first.
    n = torch.zeros(rows * buckets, dtype=torch.int64, device=device).index_add_(
        0, (row * buckets + bucket).reshape(-1), torch.ones_like(bucket).reshape(-1))
    n = n.view(rows, buckets).double()
    means = torch.where(n > 0, (total / torch.clamp(n, min=1.0)).float(),
                        torch.zeros(rows, buckets, device=device))
    raw = _value_bits(means, values)
    payload[:, :shape.nb_offset] = raw
    payload[:, shape.nb_offset:shape.ids_offset] = (
        torch.stack([nb & 0xFF, nb >> 8], 2).to(torch.uint8).reshape(rows, -1))
    payload[:, shape.ids_offset:shape.ids_offset + shape.id_bytes] = (
        _pack(ids, shape.bits, shape.id_bytes))
    payload[:, shape.ids_offset + shape.id_bytes:shape.total] = 0
    if residual is not None:
        sent = torch.gather(_read_values(raw, values), 1, bucket)
        torch.sub(x, sent, out=residual)
        # As the C++ kernels' residual_of: where a bucket's mean is not finite (one inf or
        # NaN in it, or a value beyond the values' range) a value within that range keeps
        # all of x; a residual still not finite is kept as 0.
        torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        sendable = x.abs() <= torch.finfo(values).max
        torch.where(torch.isfinite(sent) | ~sendable, residual, x, out=residual)


def decode_blocks(payload: torch.Tensor, k: int, buckets: int, values: torch.dtype,
                  out: torch.Tensor, add: bool) -> None:
    """out[r] = the decoded row r of `payload` (add: out[r] += it); `out` holds float32 rows
    of one length, which gives the count."""
    rows, count = out.shape
    if count == 0 or rows == 0:
        return
    shape = layout(count, k, buckets, values)
    means = _read_values(payload[:, :shape.nb_offset], values)
    pairs = payload[:, shape.nb_offset:shape.ids_offset].reshape(rows, k, 2).to(torch.int64)
    nb = pairs[:, :, 0] | (pairs[:, :, 1] << 8)
    off = torch.cumsum(nb, 1) - nb
    ids = _unpack(payload[:, shape.ids_offset:shape.ids_offset + shape.id_bytes], shape.bits,
                  count)
    decoded = torch.gather(means, 1, _buckets(ids, nb, off))
    if add:
        out.add_(decoded)
    else:
        out.copy_(decoded)


def encode(x: torch.Tensor, k: int, sample: int, buckets: int, values: torch.dtype,
           stream: int, payload: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """Encode one float32 block `x` into uint8 `payload` (``layout(...).total`` bytes);
    `residual`, when given, receives x - decode(payload)."""
    encode_blocks(x.view(1, -1), k, sample, buckets, values, [stream], payload.view(1, -1),
                  residual.view(1, -1) if residual is not None else None)


def decode(payload: torch.Tensor, k: int, buckets: int, values: torch.dtype,
           out: torch.Tensor, add: bool) -> None:
    """out = the decoded block (add: out += it); out is float32 and gives the count."""
    decode_blocks(payload.view(1, -1), k, buckets, values, out.view(1, -1), add)
