"""Cluster-and-hash quantization kernels and compressor, single process, against a numpy
reference implementation of the same algorithm (csrc/cluster_quant.h states the rules)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusionring import _C
from fusionring.compression import ClusterCompressor, Compression
from fusionring.compression import cluster as clusterlib

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B1
CODES = {torch.float32: 0}
CODES.update({t: clusterlib.VALUE_CODES[t] for t in (torch.float16, torch.bfloat16)})


# ---------------------------------------------------------------------- numpy reference
def splitmix64(state: int):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def ref_stream(seed: int, step: int, at: int) -> int:
    s, r = splitmix64(seed)
    s, r = splitmix64(r ^ step)
    s, r = splitmix64(r ^ at)
    return r


def ref_fit(x: np.ndarray, k: int, sample: int, buckets: int, stream: int):
    """Sample, K-means, scores and bucket allocation -> (centres, bounds, buckets per cluster)."""
    count = x.size
    if count <= sample:
        s = x
    else:
        state, idx = stream, []
        for _ in range(sample):
            state, r = splitmix64(state)
            idx.append((r * count) >> 64)
        s = x[np.array(idx, dtype=np.int64)]
    s = np.sort(s[np.isfinite(s)]).astype(np.float32)
    S = s.size
    prefix = np.concatenate([[0.0], np.cumsum(s.astype(np.float64))])
    centres = np.array([s[((2 * j + 1) * S) // (2 * k)] if S else 0.0 for j in range(k)],
                       dtype=np.float32)

    def bounds_of(c):
        return ((c[:-1] + c[1:]) * np.float32(0.5)).astype(np.float32)

    def run(b, j):
        lo = 0 if j == 0 else int(np.searchsorted(s, b[j - 1], side="right"))
        hi = S if j == k - 1 else int(np.searchsorted(s, b[j], side="right"))
        return lo, max(lo, hi)

    for _ in range(32 if S else 0):
        b = bounds_of(centres)
        nxt = centres.copy()
        for j in range(k):
            lo, hi = run(b, j)
            if hi > lo:
                nxt[j] = np.float32((prefix[hi] - prefix[lo]) / (hi - lo))
        moved = bool(np.any(nxt != centres))
        centres = nxt
        if not moved:
            break
    b = bounds_of(centres)
    density, value, entropy = [], [], []
    for j in range(k):
        lo, hi = run(b, j)
        n = hi - lo
        density.append(n / S if S else 0.0)
        value.append(abs(float(centres[j])))
        h = 0.0
        if n > 1 and s[hi - 1] != s[lo]:
            first = float(s[lo])
            width = float(s[hi - 1]) - first
            which = ((s[lo:hi].astype(np.float64) - first) / width * 8).astype(np.int64)
            counts = np.bincount(np.minimum(which, 7), minlength=8)
            for c in counts:
                if c:
                    q = c / n
                    h -= q * math.log2(q)
        entropy.append(h)
    for f in (density, value, entropy):
        top = max(f)
        f[:] = [v / top if top > 0 else 1.0 for v in f]
    score = [d * v * h for d, v, h in zip(density, value, entropy)]
    total = 0.0
    for v in score:
        total += v
    extra = buckets - k
    nb, frac = [], []
    for j in range(k):
        if total > 0:
            exact = extra * score[j] / total
            share = math.floor(exact)
            frac.append(exact - share)
        else:
            share = extra // k
            frac.append(1.0 if j < extra % k else 0.0)
        nb.append(1 + share)
    order = sorted(range(k), key=lambda j: -frac[j])
    for r in range(extra - (sum(nb) - k)):
        nb[order[r % k]] += 1
    return centres, b, np.array(nb, dtype=np.int64)


def ref_buckets(count: int, ids: np.ndarray, nb: np.ndarray) -> np.ndarray:
    off = np.concatenate([[0], np.cumsum(nb)[:-1]])
    h = (np.arange(count, dtype=np.uint64) * GOLDEN) & 0xFFFFFFFF
    return off[ids] + (((h >> 16) * nb[ids].astype(np.uint64)) >> 16).astype(np.int64)


def ref_encode(x: np.ndarray, k: int, sample: int, buckets: int, values: torch.dtype,
               stream: int):
    """-> (payload bytes, centres, ids, decoded values)."""
    x = np.asarray(x, np.float32)
    count = x.size
    centres, b, nb = ref_fit(x, k, sample, buckets, stream)
    ids = np.searchsorted(b, x, side="left").astype(np.int64)  # #{boundary < x}
    ids[np.isnan(x)] = 0
    bucket = ref_buckets(count, ids, nb)
    # Lane i % 16 accumulates in element order, lanes added in order (as the kernels do).
    sums = np.zeros(buckets)
    counts = np.zeros(buckets)
    lane_sums = []
    for lane in range(16):
        ls, lc = np.zeros(buckets), np.zeros(buckets)
        np.add.at(ls, bucket[lane::16], x[lane::16].astype(np.float64))
        np.add.at(lc, bucket[lane::16], 1.0)
        lane_sums.append((ls, lc))
    for ls, lc in lane_sums:
        sums = sums + ls
        counts = counts + lc
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
    sent = torch.from_numpy(means).to(values)
    decoded_means = sent.float().numpy()
    bits = max(1, math.ceil(math.log2(k)))
    stream_bits = ((ids[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    packed = np.packbits(stream_bits, bitorder="little")
    body = (sent.view(torch.uint8).numpy().tobytes() + nb.astype("<u2").tobytes()
            + packed.tobytes())
    body += b"\0" * (-len(body) % 8)
    return body, centres, ids, decoded_means[bucket]


# ---------------------------------------------------------------------- helpers
LEVELS = {"avx512": 2, "avx2": 1, "portable": 0}
BEST = _C.cluster_set_vector_level(2)  # the level the module picks: the widest the CPU has


@pytest.fixture(params=list(LEVELS))
def kernel_path(request):
    """Run a test with each kernel family the CPU has (AVX-512, AVX2, the portable loops)."""
    level = LEVELS[request.param]
    if _C.cluster_set_vector_level(level) != level:
        _C.cluster_set_vector_level(BEST)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    _C.cluster_set_vector_level(BEST)


def encode(x: np.ndarray, k=16, sample=4096, buckets=64, values=torch.float32, stream=7,
           residual=False):
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    payload = torch.zeros(_C.cluster_payload_bytes(t.numel(), k, sample, buckets, CODES[values]),
                          dtype=torch.uint8)
    res = torch.full((t.numel(),), float("nan")) if residual else None
    centres = _C.cluster_encode(t.data_ptr(), t.numel(), k, sample, buckets, CODES[values],
                                stream, payload.data_ptr(), res.data_ptr() if residual else 0)
    return payload, centres, res


def decode(payload, count, k=16, sample=4096, buckets=64, values=torch.float32, into=None):
    out = torch.zeros(count) if into is None else into
    _C.cluster_decode(payload.data_ptr(), count, k, sample, buckets, CODES[values],
                      out.data_ptr(), into is not None)
    return out


def gradient_like(count: int, seed: int) -> np.ndarray:
    """Heavy-tailed values around zero, as gradients are, with some exact zeros."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, count) * 1e-3).astype(np.float32)
    x[rng.random(count) < 0.05] = 0.0
    return x


# ---------------------------------------------------------------------- kernels
@pytest.mark.parametrize("count", [1, 7, 8, 9, 24, 33, 48, 63, 100, 4096, 4097, 50_001])
@pytest.mark.parametrize("k,buckets", [(16, 64), (16, 16), (4, 4), (5, 40), (2, 9), (32, 100),
                                       (256, 300)])
def test_kernels_match_the_numpy_reference_bit_for_bit(kernel_path, count, k, buckets):
    x = gradient_like(count, seed=count + k)
    stream = _C.cluster_stream(3, 5, 11)
    assert stream == ref_stream(3, 5, 11)
    payload, centres, _ = encode(x, k=k, buckets=buckets, stream=stream)
    body, ref_centres, _, ref_decoded = ref_encode(x, k, 4096, buckets, torch.float32, stream)
    np.testing.assert_array_equal(np.array(centres, np.float32), ref_centres)
    assert payload.numpy().tobytes() == body
    np.testing.assert_array_equal(decode(payload, count, k=k, buckets=buckets).numpy(),
                                  ref_decoded)


@pytest.mark.parametrize("values", [torch.float16, torch.bfloat16])
def test_16_bit_bucket_means_match_the_reference(kernel_path, values):
    x = gradient_like(20_000, seed=1) * 100
    payload, _, _ = encode(x, values=values, stream=99)
    body, _, _, ref_decoded = ref_encode(x, 16, 4096, 64, values, 99)
    assert payload.numpy().tobytes() == body
    np.testing.assert_array_equal(decode(payload, x.size, values=values).numpy(), ref_decoded)


@pytest.mark.parametrize("k,buckets", [(16, 64), (16, 16), (8, 8), (3, 3), (2, 5)])
def test_vector_and_portable_paths_give_the_same_bits(k, buckets):
    x = gradient_like(100_003, seed=4)
    out = {}
    for level in range(BEST + 1):
        _C.cluster_set_vector_level(level)
        payload, _, res = encode(x, k=k, buckets=buckets, residual=True)
        added = decode(payload, x.size, k=k, buckets=buckets, into=torch.ones(x.size))
        out[level] = (payload.numpy().tobytes(), res.numpy().tobytes(),
                      decode(payload, x.size, k=k, buckets=buckets).numpy().tobytes(),
                      added.numpy().tobytes())
    _C.cluster_set_vector_level(BEST)
    assert all(out[level] == out[0] for level in out)


@pytest.mark.parametrize("k,bits", [(2, 1), (3, 2), (4, 2), (5, 3), (16, 4), (17, 5), (256, 8)])
def test_payload_size_is_id_bits_plus_the_tables_share(k, bits):
    count = 1 << 20
    assert _C.cluster_id_bits(k) == bits
    buckets = clusterlib.default_buckets(k)
    for values, size in ((torch.float32, 4), (torch.float16, 2)):
        table = buckets * size + 2 * k
        expected = (table + (count * bits + 7) // 8 + 7) // 8 * 8
        got = _C.cluster_payload_bytes(count, k, 4096, buckets, CODES[values])
        assert got == expected
        assert clusterlib.bits_per_element(count, k, None, values) == pytest.approx(
            8 * got / count)
        assert bits <= 8 * got / count < bits + 8 * (table + 8) / count
    assert _C.cluster_payload_bytes(0, 16, 4096, 64, 0) == 0


def test_decode_error_is_bounded_by_the_cluster_of_each_value(kernel_path):
    x = gradient_like(200_000, seed=2)
    payload, centres, residual = encode(x, residual=True)
    decoded = decode(payload, x.size).numpy()
    _, _, ids, _ = ref_encode(x, 16, 4096, 64, torch.float32, 7)
    for j in range(16):
        members = x[ids == j]
        if members.size:
            # a bucket's mean lies within its cluster's values, so within their range
            err = np.abs(members - decoded[ids == j])
            assert err.max() <= members.max() - members.min() + 1e-9
    np.testing.assert_array_equal(residual.numpy(), x - decoded)
    # Gaussian values: 16 levels fitted to the distribution lose about a tenth of the norm
    g = np.random.default_rng(3).standard_normal(200_000).astype(np.float32)
    payload, _, _ = encode(g)
    rel = np.linalg.norm(g - decode(payload, g.size).numpy()) / np.linalg.norm(g)
    assert 0.01 < rel < 0.15


def test_decode_and_add_equals_decode_plus_add(kernel_path):
    x = gradient_like(33_333, seed=5)
    payload, _, _ = encode(x)
    base = torch.from_numpy(gradient_like(33_333, seed=6))
    added = decode(payload, x.size, into=base.clone())
    assert torch.equal(added, base + decode(payload, x.size))


def test_the_same_seed_gives_the_same_bits_and_another_seed_another_sample():
    x = gradient_like(500_000, seed=8)
    a, ca, _ = encode(x, stream=_C.cluster_stream(0, 0, 0))
    b, cb, _ = encode(x, stream=_C.cluster_stream(0, 0, 0))
    c, cc, _ = encode(x, stream=_C.cluster_stream(1, 0, 0))
    assert torch.equal(a, b) and ca == cb
    assert ca != cc


def test_constant_and_tiny_blocks_decode_exactly():
    for x in (np.full(1000, 0.25, np.float32), np.zeros(10, np.float32),
              np.array([1.0, -2.0], np.float32)):
        payload, _, _ = encode(x)
        np.testing.assert_array_equal(decode(payload, x.size).numpy(), x)


@pytest.mark.parametrize("bad,match", [
    (dict(k=1), "k=1"), (dict(k=257), "k=257"), (dict(buckets=8), "buckets=8"),
    (dict(buckets=70000), "buckets=70000"), (dict(sample=0), "sample")])
def test_the_core_rejects_bad_configurations_by_name(bad, match):
    args = dict(k=16, sample=4096, buckets=64)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        _C.cluster_payload_bytes(100, args["k"], args["sample"], args["buckets"], 0)


# ---------------------------------------------------------------------- the compressor
@pytest.mark.parametrize("kwargs,name", [
    (dict(k=1), "k"), (dict(k=300), "k"), (dict(k=2.5), "k"), (dict(sample=8), "sample"),
    (dict(buckets=3), "buckets"), (dict(buckets=10 ** 6), "buckets"),
    (dict(values=torch.int32), "values"), (dict(seed=-1), "seed")])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Compression.cluster(**kwargs)


def test_defaults_and_registration():
    c = Compression.cluster()
    assert isinstance(c, ClusterCompressor)
    assert (c.k, c.sample, c.buckets, c.values, c.error_feedback, c.seed) == (
        16, 4096, 16, torch.float32, True, 0)
    import fusionring.torch as hvd
    assert hvd.Compression.cluster is Compression.cluster


def test_compress_decompress_round_trip_matches_the_kernels():
    c = Compression.cluster(error_feedback=False, seed=3)
    t = torch.from_numpy(gradient_like(30_000, seed=9)).reshape(300, 100)
    payload, ctx = c.compress(t, name="w")
    assert payload.dtype == torch.uint8 and payload.numel() == c.payload_bytes(t.numel())
    body, _, _, decoded = ref_encode(t.numpy().reshape(-1), 16, 4096, 16, torch.float32,
                                     ref_stream(3, 0, 0))
    assert payload.numpy().tobytes() == body
    out = c.decompress(payload, ctx)
    assert out.shape == t.shape
    np.testing.assert_array_equal(out.numpy().reshape(-1), decoded)
    with pytest.raises(ValueError, match="payload"):
        c.decompress(payload[:-8], ctx)


def test_error_feedback_sends_everything_over_time():
    """Everything sent plus the last residual equals the sum of all inputs."""
    c = Compression.cluster(k=4)
    rng = np.random.default_rng(0)
    total_in = np.zeros(5000)
    total_sent = np.zeros(5000)
    for _ in range(6):
        g = torch.from_numpy(rng.standard_normal(5000).astype(np.float32))
        total_in += g.numpy()
        payload, ctx = c.compress(g, name="g")
        total_sent += c.decompress(payload, ctx).numpy()
    residual = c.memory.residuals["g"].numpy()
    np.testing.assert_allclose(total_sent + residual, total_in, atol=1e-4)
    assert np.abs(residual).max() > 0


def test_state_dict_resumes_the_residuals_and_the_sampling_position():
    a = Compression.cluster(seed=5)
    rng = np.random.default_rng(1)
    grads = [torch.from_numpy(rng.standard_normal(20_000).astype(np.float32)) for _ in range(3)]
    a.compress(grads[0], name="g")
    state = a.state_dict()
    b = Compression.cluster(seed=5)
    b.load_state_dict(state)
    assert b.position == 1
    for g in grads[1:]:
        pa, _ = a.compress(g, name="g")
        pb, _ = b.compress(g, name="g")
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="configuration"):
        Compression.cluster(k=8).load_state_dict(state)


@pytest.mark.parametrize("level", range(BEST + 1))
def test_a_residual_that_is_not_finite_is_kept_as_zero(level):
    """inf and NaN gradients leave a residual of 0 (carried on they would spoil every later
    step). A finite value whose bucket mean they made not finite keeps all of itself, as
    nothing finite was sent for it; elsewhere the residual is the input minus what was sent."""
    torch.manual_seed(0)
    x = torch.randn(5000)
    x[::97] = float("inf")
    x[1::89] = float("nan")
    _C.cluster_set_vector_level(level)
    try:
        c = ClusterCompressor(k=4, sample=64)
        payload, ctx = c.compress(x, name="w")
    finally:
        _C.cluster_set_vector_level(BEST)
    sent = c.decompress(payload, ctx)
    residual = c.memory.residuals["w"].reshape(-1)
    assert torch.isfinite(residual).all()
    spoiled = ~torch.isfinite(sent) & torch.isfinite(x)
    assert spoiled.sum() > 1000  # most buckets hold an inf or a NaN here
    want = x - sent
    want[~torch.isfinite(want)] = 0
    want[spoiled] = x[spoiled]
    torch.testing.assert_close(residual, want, rtol=0, atol=0)
    # Everything finite is either sent or kept: sent + residual == x wherever both are finite.
    both = torch.isfinite(sent) & torch.isfinite(x)
    torch.testing.assert_close((sent + residual)[both], x[both], rtol=0, atol=1e-6)
    torch.testing.assert_close(residual[spoiled], x[spoiled], rtol=0, atol=0)


@pytest.mark.parametrize("level", range(BEST + 1))
def test_values_beyond_float16s_range_are_not_kept_where_they_spoiled_their_bucket(level):
    """With float16 values, a finite 1e5 makes its bucket's mean inf. Kept as residual it would
    do so again at every later step; so it is kept as 0, while the other values of its bucket
    keep all of themselves, and every other residual is x minus what was sent."""
    torch.manual_seed(1)
    x = torch.randn(6000)
    x[::3] = 1e5 + torch.randn(2000)   # with k=2 these share a cluster with the 6e4
    x[1::3] = 6e4 + torch.randn(2000)
    _C.cluster_set_vector_level(level)
    try:
        c = ClusterCompressor(k=2, sample=64, values=torch.float16)
        payload, ctx = c.compress(x, name="w")
    finally:
        _C.cluster_set_vector_level(BEST)
    sent = c.decompress(payload, ctx)
    residual = c.memory.residuals["w"].reshape(-1)
    beyond = x.abs() > 65504
    spoiled = ~torch.isfinite(sent)
    assert (spoiled & ~beyond).sum() > 1000 and (spoiled & beyond).sum() > 1000
    want = x - sent
    want[spoiled] = x[spoiled]
    want[beyond] = 0
    torch.testing.assert_close(residual, want, rtol=0, atol=0)
    # The next step with ordinary gradients is finite everywhere.
    payload, ctx = c.compress(torch.randn(6000), name="w")
    assert torch.isfinite(c.decompress(payload, ctx)).all()
