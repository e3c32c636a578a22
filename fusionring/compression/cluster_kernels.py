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
"""
from __future__ import annotations

import dataclasses
from typing import Optional

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


def _sample(x: torch.Tensor, sample: int, stream: int):
    """The sorted sample, non-finite values last as +inf, and how many are finite (a device
    scalar)."""
    count = x.numel()
    if count <= sample:
        drawn = x
    else:
        if count >= 1 << 31:
            raise ValueError(f"Compression.cluster blocks on a GPU hold under 2**31 values, "
                             f"not {count}")
        n = torch.arange(1, sample + 1, dtype=torch.int64, device=x.device)
        r = _splitmix64(n * _signed(_GOLDEN64) + _signed(stream))
        # index = (r * count) >> 64 on the unsigned draw r, from its 32-bit halves
        high, low = _shr(r, 32), r & _MASK32
        index = (high * count + _shr(low * count, 32)) >> 32
        drawn = x[index]
    finite = torch.isfinite(drawn)
    s = torch.sort(torch.where(finite, drawn, torch.full_like(drawn, float("inf")))).values
    return s, finite.sum()


def _bounds(centres: torch.Tensor) -> torch.Tensor:
    return (centres[:-1] + centres[1:]) * 0.5


def _runs(s: torch.Tensor, bounds: torch.Tensor, count: torch.Tensor):
    """First and end position of each cluster's run of the sorted sample (its finite part)."""
    ends = torch.clamp(torch.searchsorted(s, bounds, right=True), max=count)
    zero = torch.zeros(1, dtype=ends.dtype, device=ends.device)
    lo = torch.cat([zero, ends])
    hi = torch.maximum(torch.cat([ends, count.reshape(1).to(ends.dtype)]), lo)
    return lo, hi


def _sequential_sum(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The sum in index order, as the core adds (a cumulative sum's last entry)."""
    return torch.cumsum(t, dim=dim).select(dim, -1)


def fit(x: torch.Tensor, k: int, sample: int, buckets: int, stream: int):
    """K-means centres' boundaries, buckets per cluster and each cluster's first bucket."""
    s, S = _sample(x, sample, stream)
    device = x.device
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64, device=device),
                        torch.cumsum(s.double(), 0)])
    j = torch.arange(k, dtype=torch.int64, device=device)
    start = torch.clamp((2 * j + 1) * S // (2 * k), max=s.numel() - 1)
    centres = torch.where(S > 0, s[start], torch.zeros_like(s[start]))
    for _ in range(LLOYD_STEPS):
        lo, hi = _runs(s, _bounds(centres), S)
        n = hi - lo
        mean = ((prefix[hi] - prefix[lo]) / n.double()).float()
        centres = torch.where(n > 0, mean, centres)
    bounds = _bounds(centres)
    lo, hi = _runs(s, bounds, S)
    n = hi - lo

    # Scores: density x |centre| x entropy, each normalised by its maximum.
    density = torch.where(S > 0, n.double() / S.double(), torch.zeros_like(n, dtype=torch.float64))
    value = centres.double().abs()
    first = s[torch.clamp(lo, max=s.numel() - 1)].double()
    last = s[torch.clamp(hi - 1, min=0, max=s.numel() - 1)].double()
    spread = (n > 1) & (last != first)
    width = torch.where(spread, last - first, torch.ones_like(first))
    position = torch.arange(s.numel(), dtype=torch.int64, device=device)
    owner = torch.clamp(torch.searchsorted(lo, position, right=True) - 1, min=0)
    inside = (position < S) & (position < hi[owner]) & spread[owner]
    scaled = (s.double() - first[owner]) / width[owner] * ENTROPY_BINS
    scaled = torch.where(inside, scaled, torch.zeros_like(scaled))
    bin_ = torch.clamp(scaled.to(torch.int64), max=ENTROPY_BINS - 1)
    bins = torch.zeros(k * ENTROPY_BINS, dtype=torch.int64, device=device)
    bins.index_add_(0, owner * ENTROPY_BINS + bin_, inside.to(torch.int64))
    q = bins.view(k, ENTROPY_BINS).double() / torch.clamp(n, min=1).double().unsqueeze(1)
    terms = torch.where(q > 0, q * torch.log2(torch.where(q > 0, q, torch.ones_like(q))),
                        torch.zeros_like(q))
    entropy = -_sequential_sum(terms, 1)
    entropy = torch.where(spread, entropy, torch.zeros_like(entropy))
    factors = []
    for f in (density, value, entropy):
        top = torch.clamp(f.max(), min=0.0)
        factors.append(torch.where(top > 0, f / torch.where(top > 0, top, torch.ones_like(top)),
                                   torch.ones_like(f)))
    score = factors[0] * factors[1] * factors[2]
    total = _sequential_sum(score)

    # Buckets: one each, the rest in proportion to the scores by largest remainders.
    extra = buckets - k
    exact = extra * score / torch.where(total > 0, total, torch.ones_like(total))
    share = torch.where(total > 0, torch.floor(exact),
                        torch.full_like(exact, float(extra // k)))
    frac = torch.where(total > 0, exact - share, (j < extra % k).double())
    share = share.to(torch.int64)
    remaining = torch.clamp(extra - share.sum(), min=0)
    order = torch.sort(frac, descending=True, stable=True).indices
    more = remaining // k + (j < remaining % k).to(torch.int64)  # the r-th goes to order[r % k]
    nb = (1 + share).index_add_(0, order, more)
    off = torch.cumsum(nb, 0) - nb
    return bounds, nb, off


def _cluster_ids(x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """#{ j : boundary_j < x }, NaN in cluster 0."""
    ids = torch.searchsorted(bounds, x)
    return torch.where(torch.isnan(x), torch.zeros_like(ids), ids)


def _buckets(ids: torch.Tensor, nb: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    index = torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
    h = (index * _GOLDEN32) & _MASK32
    return off[ids] + (((h >> 16) * nb[ids]) >> 16)


def _value_bits(means: torch.Tensor, values: torch.dtype) -> torch.Tensor:
    """The bucket means as the payload stores them, as bytes (the core's roundings)."""
    if values == torch.float32:
        return means.view(torch.uint8)
    bits = means.view(torch.int32).to(torch.int64) & _MASK32
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if values == torch.bfloat16:
        word = _shr(bits + 0x7FFF + (_shr(bits, 16) & 1), 16)
        word = torch.where(nan, _shr(bits, 16) | 0x40, word)
    else:  # float16: torch rounds to nearest even, as the core does; NaN is made quiet
        word = means.half().view(torch.int16).to(torch.int64)
        word = torch.where(nan, (_shr(bits, 16) & 0x8000) | 0x7E00, word)
    word = word & 0xFFFF
    return torch.stack([word & 0xFF, word >> 8], 1).to(torch.uint8).reshape(-1)


def _read_values(raw: torch.Tensor, values: torch.dtype) -> torch.Tensor:
    return raw.view(values).float()


def _pack(ids: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """ids as a little-endian stream of `bits`-bit fields."""
    if bits == 8:
        return ids.to(torch.uint8)
    shifts = torch.arange(bits, dtype=torch.uint8, device=ids.device)
    planes = ((ids.to(torch.uint8).unsqueeze(1) >> shifts) & 1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=ids.device)
    padded[:planes.numel()] = planes
    weights = torch.arange(8, dtype=torch.uint8, device=ids.device)
    return (padded.view(nbytes, 8) << weights).sum(1, dtype=torch.uint8)


def _unpack(raw: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    if bits == 8:
        return raw[:count].to(torch.int64)
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)
    planes = ((raw.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count * bits]
    weights = torch.arange(bits, dtype=torch.int64, device=raw.device)
    return (planes.view(count, bits).to(torch.int64) << weights).sum(1)


def encode(x: torch.Tensor, k: int, sample: int, buckets: int, values: torch.dtype,
           stream: int, payload: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """Encode float32 block `x` into uint8 `payload` (``layout(...).total`` bytes, 8-byte
    aligned); `residual`, when given, receives x - decode(payload)."""
    count = x.numel()
    if count == 0:
        return
    shape = layout(count, k, buckets, values)
    bounds, nb, off = fit(x, k, sample, buckets, stream)
    ids = _cluster_ids(x, bounds)
    bucket = _buckets(ids, nb, off)
    lane = torch.arange(count, dtype=torch.int64, device=x.device) % LANES
    sums = torch.zeros(LANES * buckets, dtype=torch.float64, device=x.device)
    sums.index_add_(0, lane * buckets + bucket, x.double())
    total = _sequential_sum(sums.view(LANES, buckets))
    # Counted with index_add_: bincount sizes its result from the input's maximum, which a
    # GPU would have to send to the host first.
    n = torch.zeros(buckets, dtype=torch.int64, device=x.device).index_add_(
        0, bucket, torch.ones_like(bucket)).double()
    means = torch.where(n > 0, (total / torch.clamp(n, min=1.0)).float(),
                        torch.zeros(buckets, device=x.device))
    raw = _value_bits(means, values)
    payload[:shape.nb_offset].copy_(raw)
    payload[shape.nb_offset:shape.ids_offset].copy_(
        torch.stack([nb & 0xFF, nb >> 8], 1).to(torch.uint8).reshape(-1))
    payload[shape.ids_offset:shape.ids_offset + shape.id_bytes].copy_(
        _pack(ids, shape.bits, shape.id_bytes))
    payload[shape.ids_offset + shape.id_bytes:shape.total].zero_()
    if residual is not None:
        stored = _read_values(raw, values)
        torch.sub(x, stored[bucket], out=residual)


def decode(payload: torch.Tensor, k: int, buckets: int, values: torch.dtype,
           out: torch.Tensor, add: bool) -> None:
    """out = the decoded block (add: out += it); out is float32 and gives the count."""
    count = out.numel()
    if count == 0:
        return
    shape = layout(count, k, buckets, values)
    means = _read_values(payload[:shape.nb_offset], values)
    pairs = payload[shape.nb_offset:shape.ids_offset].view(k, 2).to(torch.int64)
    nb = pairs[:, 0] | (pairs[:, 1] << 8)
    off = torch.cumsum(nb, 0) - nb
    ids = _unpack(payload[shape.ids_offset:shape.ids_offset + shape.id_bytes], shape.bits,
                  count)
    decoded = means[_buckets(ids, nb, off)]
    if add:
        out.add_(decoded)
    else:
        out.copy_(decoded)
