"""N:M sparsification kernels and compressor, single process, against numpy references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusionring import _C
from fusionring.compression import Compression, NMCompressor
from fusionring.compression import nm as nmlib
from fusionring.compression import pipeline

PAIRS = [(1, 4), (2, 4), (1, 2), (2, 8), (4, 8), (1, 8), (4, 4), (3, 5), (5, 16), (7, 32),
         (16, 32), (1, 1), (2, 3)]
COUNTS = [0, 1, 5, 63, 64, 65, 1000, 4099]
NP_VALUES = {torch.float32: np.float32, torch.float16: np.float16}


# ---------------------------------------------------------------------- numpy reference
def ref_keep(x: np.ndarray, n: int, m: int) -> np.ndarray:
    """Top-n of every m by |x| (bits of |x| as the key, NaN above inf), lower index on ties;
    a tail of L < m keeps min(n, L). A stable sort on the negated key gives that order."""
    x = np.asarray(x, dtype=np.float32)
    keys = (x.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)
    keep = np.zeros(x.size, dtype=bool)
    for start in range(0, x.size, m):
        group = keys[start:start + m]
        order = np.argsort(-group, kind="stable")
        keep[start + order[:min(n, group.size)]] = True
    return keep


def round_values(v: np.ndarray, values: torch.dtype) -> np.ndarray:
    """What a float32 becomes after travelling as `values` (round to nearest even)."""
    return torch.from_numpy(np.asarray(v, np.float32)).to(values).float().numpy()


def sample(count: int, seed: int) -> np.ndarray:
    """Gaussian data with many exact ties (+-0.5, zeros, -0) to exercise the tie rule."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(count).astype(np.float32)
    x[rng.random(count) < 0.15] = 0.5
    x[rng.random(count) < 0.1] = -0.5
    x[rng.random(count) < 0.05] = 0.0
    x[rng.random(count) < 0.02] = -0.0
    return x


LEVELS = {"avx512": 2, "avx2": 1, "portable": 0}


@pytest.fixture(params=list(LEVELS))
def kernel_path(request):
    """Run a test with each kernel family the CPU has: AVX-512, AVX2 and the portable loops."""
    level = LEVELS[request.param]
    if level > _C.nm_vector_level_available():
        pytest.skip(f"this CPU has no {request.param}")
    _C.nm_set_vector_level(level)
    yield request.param
    _C.nm_set_vector_level(2)


# ---------------------------------------------------------------------- kernels
@pytest.mark.parametrize("n,m", PAIRS)
def test_selection_matches_numpy_top_n_of_m_with_lower_index_winning_ties(kernel_path, n, m):
    for count in COUNTS:
        x = sample(count, seed=count + 31 * m + n)
        residual = torch.full((count,), 7.0)
        kept, mask = nmlib.compress_values(torch.from_numpy(x), n, m, residual=residual)
        keep = ref_keep(x, n, m)
        assert nmlib.mask_to_bool(mask, count).numpy().tolist() == keep.tolist()
        assert kept.numpy().view(np.uint32).tolist() == x[keep].view(np.uint32).tolist()
        assert kept.numel() == _C.nm_kept_count(count, n, m) == keep.sum()
        assert np.array_equal(residual.numpy(), np.where(keep, 0.0, x).astype(np.float32))
        assert torch.equal(nmlib.select_mask(torch.from_numpy(x), n, m), mask)


def test_tail_group_keeps_min_of_n_and_its_length():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, -9.0, 0.25])  # 2:4 -> groups of 4 and 3
    kept, mask = nmlib.compress_values(x, 2, 4)
    assert kept.tolist() == [3.0, 4.0, 5.0, -9.0]
    kept, mask = nmlib.compress_values(x[:5], 2, 4)  # a tail of one keeps one
    assert kept.tolist() == [3.0, 4.0, 5.0]
    assert _C.nm_kept_count(7, 2, 4) == 4 and _C.nm_kept_count(5, 2, 4) == 3
    assert _C.nm_kept_count(10, 3, 8) == 3 + 2


def test_nan_ranks_above_infinity_and_minus_zero_ties_plus_zero():
    x = torch.tensor([float("inf"), float("nan"), 1.0, 2.0, -0.0, 0.0, 0.0, -0.0])
    _, mask = nmlib.compress_values(x, 2, 4)
    assert nmlib.mask_to_bool(mask, 8).tolist() == [True, True, False, False,
                                                    True, True, False, False]


@pytest.mark.parametrize("values", [torch.float32, torch.float16, torch.bfloat16])
def test_values_travel_rounded_to_nearest_even_and_residual_holds_the_rest(kernel_path, values):
    for n, m in [(2, 4), (1, 8), (5, 16), (2, 3)]:
        for count in [0, 7, 64, 1001]:
            x = sample(count, seed=count + m) * np.float32(300.0)
            residual = torch.empty(count)
            kept, mask = nmlib.compress_values(torch.from_numpy(x), n, m, values, residual)
            keep = ref_keep(x, n, m)
            expected = torch.from_numpy(x[keep]).to(values)
            assert kept.dtype == values
            assert kept.view(torch.int16 if values != torch.float32 else torch.int32).tolist() == \
                expected.view(torch.int16 if values != torch.float32 else torch.int32).tolist()
            decoded = np.where(keep, round_values(x, values), 0.0).astype(np.float32)
            assert np.array_equal(residual.numpy(), (x - decoded).astype(np.float32))
            out = nmlib.scatter(kept, mask, count)
            assert np.array_equal(out.numpy(), decoded)
            assert np.array_equal(out.numpy() + residual.numpy(), x)


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16])
def test_16_bit_inputs_select_like_their_float32_values(kernel_path, src):
    for n, m in [(2, 4), (3, 5), (7, 32)]:
        x = torch.from_numpy(sample(5000, seed=m)).to(src)
        kept, mask = nmlib.compress_values(x, n, m)
        keep = ref_keep(x.float().numpy(), n, m)
        assert nmlib.mask_to_bool(mask, 5000).numpy().tolist() == keep.tolist()
        assert torch.equal(kept, x.float()[torch.from_numpy(keep)])


def test_unpack_writes_zeros_elsewhere_and_unpack_accumulate_adds(kernel_path):
    for n, m in [(2, 4), (1, 2), (4, 8), (5, 16)]:
        for values in [torch.float32, torch.float16, torch.bfloat16]:
            count = 2053
            x = sample(count, seed=n * m)
            kept, mask = nmlib.compress_values(torch.from_numpy(x), n, m, values)
            keep = ref_keep(x, n, m)
            decoded = np.where(keep, round_values(x, values), 0.0).astype(np.float32)
            out = torch.full((count,), 3.0)
            nmlib.scatter(kept, mask, count, out=out)
            assert np.array_equal(out.numpy(), decoded)
            base = sample(count, seed=99)
            acc = torch.from_numpy(base.copy())
            nmlib.scatter(kept, mask, count, out=acc, accumulate=True)
            assert np.array_equal(acc.numpy(), np.where(keep, base + decoded, base))
            half = torch.empty(count, dtype=torch.float16)
            _C.nm_scatter(kept.data_ptr(), nmlib.VALUE_CODES[values], mask.data_ptr(), count,
                          half.data_ptr(), 2)
            assert torch.equal(half, torch.from_numpy(decoded).half())


def test_gather_by_a_given_mask_packs_exactly_the_masked_values(kernel_path):
    rng = np.random.default_rng(5)
    for count in [1, 63, 64, 200, 4097]:
        x = sample(count, seed=count)
        mask = torch.from_numpy(rng.integers(-2**63, 2**63 - 1, size=_C.nm_mask_words(count),
                                             dtype=np.int64))  # bits past `count` are ignored
        bits = nmlib.mask_to_bool(mask, count).numpy()
        residual = torch.empty(count)
        kept = nmlib.gather(torch.from_numpy(x), mask, torch.float32, residual)
        assert kept.numpy().view(np.uint32).tolist() == x[bits].view(np.uint32).tolist()
        assert np.array_equal(residual.numpy(), np.where(bits, 0.0, x).astype(np.float32))
        assert np.array_equal(nmlib.scatter(kept, mask, count).numpy(),
                              np.where(bits, x, 0.0).astype(np.float32))


def test_every_kernel_family_gives_identical_bytes():
    levels = list(range(_C.nm_vector_level_available() + 1))
    if len(levels) == 1:
        pytest.skip("this CPU has no vector kernels")
    x = torch.from_numpy(sample(100_003, seed=1) * np.float32(1e3))
    for n, m in [(2, 4), (1, 8), (3, 16), (9, 32), (1, 2)]:
        for values in [torch.float32, torch.float16, torch.bfloat16]:
            results = []
            for level in levels:
                _C.nm_set_vector_level(level)
                residual = torch.empty(x.numel())
                kept, mask = nmlib.compress_values(x, n, m, values, residual)
                acc = torch.ones(x.numel())
                nmlib.scatter(kept, mask, x.numel(), out=acc, accumulate=True)
                results.append((kept, mask, residual, nmlib.scatter(kept, mask, x.numel()), acc,
                                nmlib.gather(x, mask, values)))
            _C.nm_set_vector_level(2)
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------- size and validation
@pytest.mark.parametrize("values,shared,bits", [
    (torch.float32, False, 17), (torch.float16, False, 9), (torch.bfloat16, False, 9),
    (torch.float32, True, 16), (torch.float16, True, 8)])
def test_bits_per_element_of_2_4_payloads_match_the_formula(values, shared, bits):
    c = Compression.nm(2, 4, values=values, shared_mask=shared)
    t = torch.randn(64, 1024)
    c.decompress(*c.compress(t, name="w"))  # a shared mask needs one (dense) reduction first
    payload, ctx = c.compress(t, name="w")
    parts = payload if isinstance(payload, tuple) else (payload,)
    measured = sum(p.numel() * p.element_size() for p in parts) * 8 / t.numel()
    assert measured == bits == nmlib.bits_per_element(2, 4, values, shared)


def test_first_shared_mask_step_is_dense():
    c = Compression.nm(1, 4)
    payload, ctx = c.compress(torch.randn(400), name="w")
    assert payload.numel() == 400 and ctx.mask is None
    assert nmlib.bits_per_element(4, 4, torch.float16) == 16.0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(n=0, m=4), "n=0"), (dict(n=5, m=4), "n=5"), (dict(n=1, m=33), "m=33"),
    (dict(n=1, m=0), "m=0"), (dict(n=2.0, m=4), "n must be an int"),
    (dict(values=torch.int32), "values dtype"), (dict(values=torch.float64), "values dtype"),
    (dict(schedule="sometimes"), "unknown N:M schedule"),
    (dict(schedule=[(10, (2, 4)), (5, (1, 4))]), "increase"),
    (dict(schedule=[(0, (5, 4))]), "n=5"), (dict(schedule=[(0, 4)]), "(step, (n, m))"),
])
def test_invalid_configuration_raises_value_error_naming_it(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Compression.nm(**kwargs)


def test_core_rejects_bad_arguments_with_value_error():
    x = torch.zeros(8)
    out = torch.zeros(8)
    mask = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="n=3"):
        _C.nm_compress(x.data_ptr(), 0, 8, 3, 2, out.data_ptr(), 0, mask.data_ptr(), 0)
    with pytest.raises(ValueError, match="int32"):
        _C.nm_compress(x.data_ptr(), 0, 8, 1, 2, out.data_ptr(), 4, mask.data_ptr(), 0)
    with pytest.raises(ValueError, match="int64"):
        _C.nm_select_mask(x.data_ptr(), 5, 8, 1, 2, mask.data_ptr())
    with pytest.raises(ValueError, match="selects 0 values"):
        nmlib.scatter(torch.ones(3), mask, 8)
    with pytest.raises(ValueError, match="input dtype"):
        nmlib.compress_values(torch.zeros(4, dtype=torch.int64), 1, 2)


def test_compression_keeps_horovod_names_and_nm_is_a_factory():
    assert isinstance(Compression.none, type) and isinstance(Compression.fp16, type)
    a, b = Compression.nm(), Compression.nm(1, 8, values=torch.float16, shared_mask=False)
    assert isinstance(a, NMCompressor) and a is not b
    assert a.in_runtime and callable(a.communicate)
    assert a.name != b.name and "1:8" in b.name


# ---------------------------------------------------------------------- compressor behaviour
@pytest.mark.parametrize("shared", [True, False])
def test_error_feedback_conserves_the_sum_of_gradients(shared):
    c = Compression.nm(1, 4, values=torch.float16, shared_mask=shared)
    rng = np.random.default_rng(0)
    total_in = np.zeros(1000)
    total_out = np.zeros(1000)
    for step in range(12):
        g = torch.from_numpy(rng.standard_normal(1000).astype(np.float32))
        payload, ctx = c.compress(g, name="w")
        total_in += g.double().numpy()
        total_out += c.decompress(payload, ctx).double().numpy()
    residual = c.memory.residuals["w"].double().numpy()
    np.testing.assert_allclose(total_out + residual, total_in, atol=1e-4)
    assert np.abs(residual).max() > 0.0


def test_without_error_feedback_nothing_is_kept():
    c = Compression.nm(2, 4, shared_mask=False, error_feedback=False)
    g = torch.randn(64)
    payload, ctx = c.compress(g, name="w")
    assert "w" not in c.memory.residuals
    keep = ref_keep(g.numpy(), 2, 4)
    assert np.array_equal(c.decompress(payload, ctx).numpy(), np.where(keep, g.numpy(), 0))


def test_shared_mask_sends_every_position_eventually_by_waiting_time():
    c = Compression.nm(1, 4)
    g = torch.tensor([8.0, 4.0, 2.0, 1.0] * 16)
    sent = torch.zeros(64, dtype=torch.bool)
    for step in range(12):
        payload, ctx = c.compress(g, name="w")
        out = c.decompress(payload, ctx)
        if ctx.mask is not None:
            sent |= nmlib.mask_to_bool(ctx.mask, 64)
            assert int(nmlib.mask_to_bool(ctx.mask, 64).sum()) == 16
    assert bool(sent.all())


def test_shared_mask_follows_the_reduced_estimate_scaled_by_waiting_time():
    c = Compression.nm(1, 2)
    g = torch.tensor([3.0, 1.0])
    masks, payloads = [], []
    for step in range(5):
        payload, ctx = c.compress(g, name="w")
        c.decompress(payload, ctx)
        masks.append(None if ctx.mask is None else nmlib.mask_to_bool(ctx.mask, 2).tolist())
        payloads.append(payload.tolist())
    # dense first; then scores |estimate| * (1 + wait): 3 vs 1, 3 vs 2, 3 vs 3 (tie: lower
    # index), 3 vs 4 -> the second value goes, carrying the residual of its four steps.
    assert masks == [None, [True, False], [True, False], [True, False], [False, True]]
    assert payloads[-1] == [4.0]


def test_step_schedule_changes_granularity_at_the_listed_steps():
    c = Compression.nm(2, 4, shared_mask=False,
                       schedule=[(0, (4, 4)), (2, (2, 4)), (4, (1, 4))])
    seen = []
    for step in range(6):
        seen.append(c.level("w"))
        payload, ctx = c.compress(torch.randn(64), name="w")
        kept = payload[0].numel()
        assert kept == 64 * seen[-1][0] // 4
    assert seen == [(4, 4), (4, 4), (2, 4), (2, 4), (1, 4), (1, 4)]
    sched = nmlib.StepSchedule([(5, (1, 4))], initial=(2, 4))
    assert sched.at(0) == (2, 4) and sched.at(5) == (1, 4) and sched.at(10**6) == (1, 4)


def test_adaptive_schedule_moves_by_smoothed_residual_ratio():
    sched = nmlib.AdaptiveSchedule.halving(1, 4, low=0.2, high=0.5, smoothing=0.5, patience=3)
    assert sched.levels == [(4, 4), (2, 4), (1, 4)]
    state = nmlib._TensorState()
    for _ in range(3):
        sched.observe(state, 0.0)
    assert state.level == 1 and state.ema is None
    for ratio in [0.1, 0.1]:
        sched.observe(state, ratio)
    assert state.level == 1  # patience
    sched.observe(state, 0.1)
    assert state.level == 2
    for _ in range(3):
        sched.observe(state, 0.9)
    assert state.level == 1
    c = Compression.nm(1, 4, schedule="adaptive")
    assert c.level("w") == (4, 4)


@pytest.mark.parametrize("shared", [True, False])
def test_state_dict_round_trip_continues_exactly(shared):
    def run(c, steps, seed):
        rng = np.random.default_rng(seed)
        outs = []
        for _ in range(steps):
            for name, size in [("a", 300), ("b", 77)]:
                payload, ctx = c.compress(torch.from_numpy(rng.standard_normal(size)
                                                           .astype(np.float32)), name=name)
                outs.append(c.decompress(payload, ctx))
        return outs

    kwargs = dict(n=1, m=4, values=torch.bfloat16, shared_mask=shared,
                  schedule=[(0, (2, 4)), (5, (1, 4))])
    c = Compression.nm(**kwargs)
    run(c, 4, seed=0)
    saved = c.state_dict()
    continued = run(c, 4, seed=1)
    fresh = Compression.nm(**kwargs)
    fresh.load_state_dict(saved)
    resumed = run(fresh, 4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(continued, resumed))
    assert fresh.level("a") == c.level("a") == (1, 4)
    with pytest.raises(ValueError, match="configuration"):
        Compression.nm(2, 4).load_state_dict(saved)


SCRATCH_CODECS = {"nm_shared": lambda: Compression.nm(2, 4, values=torch.float16),
                  "nm_per_rank": lambda: Compression.nm(2, 4, values=torch.float16, shared_mask=False),
                  "cluster": lambda: Compression.cluster(k=4)}


@pytest.mark.parametrize("codec", sorted(SCRATCH_CODECS))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scratch_input_and_out_give_the_bits_of_the_copying_path(codec, out_dtype):
    # The DDP hooks let compress() use their bucket as scratch and decode into the bucket: the
    # same payloads, results and residuals as the copying path, step after step (the residual
    # is written over the previous one, which compress() has already added in).
    copying, in_place = SCRATCH_CODECS[codec](), SCRATCH_CODECS[codec]()
    rng = np.random.default_rng(7)
    for step in range(5):
        grad = torch.from_numpy(rng.standard_normal(1003).astype(np.float32))
        kept_grad = grad.clone()
        p1, c1 = copying.compress(grad, name="g")
        assert torch.equal(grad, kept_grad)  # without scratch the input is left alone
        bucket = grad.clone()
        p2, c2 = in_place.compress(bucket, name="g", scratch=True)
        for a, b in zip(p1 if isinstance(p1, tuple) else (p1,), p2 if isinstance(p2, tuple) else (p2,)):
            assert torch.equal(a, b), step
        expected = copying.decompress(p1, c1)
        if codec.startswith("nm"):
            out = torch.empty(1003, dtype=out_dtype)
            got = in_place.decompress(p2, c2, out=out)
            assert got is out and torch.equal(out, expected.to(out_dtype)), step
        else:
            assert torch.equal(in_place.decompress(p2, c2), expected), step
    a, b = copying.state_dict(), in_place.state_dict()
    assert torch.equal(a["residuals"]["g"], b["residuals"]["g"])
    if codec == "nm_shared":
        assert torch.equal(a["tensors"]["g"]["estimate"], b["tensors"]["g"]["estimate"])
    if codec.startswith("nm"):
        with pytest.raises(ValueError, match="out holds 10 values"):
            in_place.decompress(p2, c2, out=torch.empty(10))


@pytest.mark.parametrize("make", [lambda: Compression.nm(1, 4),
                                  lambda: Compression.nm(1, 4, shared_mask=False),
                                  lambda: Compression.cluster(k=4)])
def test_a_residual_that_no_longer_fits_its_tensor_is_dropped_with_a_warning(make):
    """A checkpoint of another model (or a name reused for another tensor) leaves residuals of
    the wrong size: they cannot be added back, and the loss is said, naming the tensor."""
    c = make()
    c.compress(torch.randn(40), name="allreduce.fc.weight")
    other = make()
    other.load_state_dict(c.state_dict())
    x = torch.randn(24)
    with pytest.warns(RuntimeWarning, match=r"tensor 'allreduce.fc.weight' holds 40 values but "
                                            r"the tensor has 24"):
        payload, ctx = other.compress(x, name="allreduce.fc.weight")
    expected, ectx = make().compress(x, name="allreduce.fc.weight")
    assert torch.equal(other.decompress(payload, ctx), make().decompress(expected, ectx))
    assert other.memory.residuals["allreduce.fc.weight"].numel() == 24


def test_kernel_encode_is_much_faster_than_numpy():
    """A loose floor (the benchmark script measures properly): 1M floats in well under 50 ms."""
    import time

    x = torch.randn(1 << 20)
    kept = torch.empty(1 << 19)
    mask = torch.empty(_C.nm_mask_words(1 << 20), dtype=torch.int64)
    best = min(_timed(lambda: _C.nm_compress(x.data_ptr(), 0, x.numel(), 2, 4, kept.data_ptr(), 0,
                                             mask.data_ptr(), 0), time) for _ in range(5))
    assert best < 0.05


def _timed(fn, time) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- GPU kernels
needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and getattr(_C, "nm_cuda_built", False)),
    reason="needs a GPU and fusionring built with CUDA")


@needs_gpu
@pytest.mark.parametrize("n,m", [(1, 4), (2, 4), (1, 2), (2, 8), (4, 8), (5, 16), (7, 32),
                                 (4, 4), (1, 1)])
@pytest.mark.parametrize("values", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernels_give_the_cpu_bits(n, m, values):
    for count in [1, 31, 32, 65, 1000, 100_003]:
        x = torch.from_numpy(sample(count, seed=count + m) * np.float32(100.0))
        cpu_res = torch.empty(count)
        cpu_kept, cpu_mask = nmlib.compress_values(x, n, m, values, cpu_res)
        gx = x.cuda()
        gpu_res = torch.empty(count, device="cuda")
        gpu_kept, gpu_mask = nmlib.compress_values(gx, n, m, values, gpu_res)
        assert torch.equal(gpu_mask.cpu(), cpu_mask)
        assert torch.equal(gpu_kept.cpu().view(torch.uint8), cpu_kept.view(torch.uint8))
        assert torch.equal(gpu_res.cpu(), cpu_res)
        assert torch.equal(nmlib.select_mask(gx, n, m).cpu(), cpu_mask)
        dense = nmlib.scatter(gpu_kept, gpu_mask, count, nm=(n, m))
        assert torch.equal(dense.cpu(), nmlib.scatter(cpu_kept, cpu_mask, count))
        acc = torch.ones(count, device="cuda")
        nmlib.scatter(gpu_kept, gpu_mask, count, out=acc, accumulate=True, nm=(n, m))
        assert torch.equal(acc.cpu(), nmlib.scatter(cpu_kept, cpu_mask, count,
                                                    out=torch.ones(count), accumulate=True))
        again = nmlib.gather(gx, gpu_mask, values, nm=(n, m))
        assert torch.equal(again.cpu().view(torch.uint8), cpu_kept.view(torch.uint8))


@needs_gpu
def test_compressor_keeps_cuda_tensors_on_the_device():
    c = Compression.nm(2, 4, shared_mask=False)
    g = torch.randn(4096, device="cuda")
    payload, ctx = c.compress(g, name="w")
    assert payload[0].is_cuda and payload[1].is_cuda
    out = c.decompress(payload, ctx)
    assert out.is_cuda
    keep = ref_keep(g.cpu().numpy(), 2, 4)
    assert np.array_equal(out.cpu().numpy(), np.where(keep, g.cpu().numpy(), 0))


# ---------------------------------------------------------------------- the shared-mask pipeline
def _run_pipeline(chunks, fail_at=None):
    import threading
    events, lock = [], threading.Lock()

    def stage(tag):
        def run(k):
            with lock:
                events.append((tag, k))
            if (tag, k) == fail_at:
                raise RuntimeError(f"{tag}{k} failed")
        return run

    error = None
    try:
        pipeline.run_pipeline(chunks, stage("encode"), stage("reduce"), stage("decode"))
    except RuntimeError as exc:
        error = str(exc)
    return events, error


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_pipeline_runs_each_stage_once_in_dependency_order(chunks):
    events, error = _run_pipeline(chunks)
    assert error is None
    assert sorted(events) == sorted((t, k) for t in ("encode", "reduce", "decode")
                                    for k in range(chunks))
    assert [k for t, k in events if t == "reduce"] == list(range(chunks))
    for k in range(chunks):
        assert events.index(("encode", k)) < events.index(("reduce", k)) < events.index(
            ("decode", k))


def test_pipeline_hands_on_a_stage_error_after_the_helper_is_done(monkeypatch):
    events, error = _run_pipeline(4, fail_at=("encode", 2))
    assert error == "encode2 failed"
    assert ("reduce", 2) not in events and ("reduce", 3) not in events

    class Refusing:  # an executor at interpreter shutdown
        def submit(self, *args):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(pipeline, "_helper", Refusing())
    events, error = _run_pipeline(3)
    assert error is None and len(events) == 9


@pytest.mark.parametrize("values", [torch.float32, torch.float16, torch.bfloat16])
def test_a_residual_that_is_not_finite_is_kept_as_zero(kernel_path, values):
    """Gradients that are not finite, or (float16) beyond the values' range, leave a residual of
    0 there, whether they were sent or held back (sent later they would arrive as inf then);
    every other element's residual is x minus what was sent, as always."""
    count = 4099
    x = sample(count, seed=5)
    x[::7] = 1e5          # beyond float16's range
    x[3::11] = np.inf
    x[5::13] = -np.inf
    x[6::17] = np.nan
    x[1000:1016] = 2e5    # whole groups beyond float16's range: some are held back
    xt = torch.from_numpy(x)
    for n, m in [(2, 4), (1, 8), (4, 4)]:
        residual = torch.full((count,), 7.0)
        kept, mask = nmlib.compress_values(xt, n, m, values, residual=residual)
        sent = nmlib.scatter(kept, mask, count).numpy()
        with np.errstate(invalid="ignore"):
            want = (x - sent).astype(np.float32)
        want[~np.isfinite(want)] = 0.0
        if values != torch.float32:
            want[~np.isfinite(torch.from_numpy(x).to(values).float().numpy())] = 0.0
        if n < m:
            assert not nmlib.mask_to_bool(mask, count).numpy()[1000:1016].all()
        np.testing.assert_array_equal(residual.numpy(), want)
        again = torch.full((count,), 7.0)
        nmlib.gather(xt, mask, values, residual=again)
        np.testing.assert_array_equal(again.numpy(), want)
