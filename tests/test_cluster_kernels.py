"""The cluster quantizer's torch kernels (for blocks on a GPU) against the core's C++ kernels:
the same payload, residual and decoded values, bit for bit, on CPU tensors; and the tensor
codec's blocks against the core's per-segment encoding."""
from __future__ import annotations

import pytest
import torch

from fusionring import _C
from fusionring.compression import cluster_kernels
from fusionring.compression.cluster_codec import ClusterCodec
from fusionring.dtypes import VALUE_CODES

CUDA = torch.cuda.is_available()


def core_encode(x, k, sample, buckets, values, stream):
    code = VALUE_CODES[values]
    payload = torch.zeros(_C.cluster_payload_bytes(x.numel(), k, sample, buckets, code),
                          dtype=torch.uint8)
    residual = torch.empty(x.numel())
    _C.cluster_encode(x.data_ptr(), x.numel(), k, sample, buckets, code, stream,
                      payload.data_ptr(), residual.data_ptr())
    return payload, residual


def torch_encode(x, k, sample, buckets, values, stream):
    shape = cluster_kernels.layout(x.numel(), k, buckets, values)
    payload = torch.full((shape.total,), 0xA5, dtype=torch.uint8, device=x.device)
    residual = torch.empty(x.numel(), device=x.device)
    cluster_kernels.encode(x, k, sample, buckets, values, stream, payload, residual)
    return payload, residual


def data(kind: str, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, generator=g)
    if kind == "heavy":
        x = x * torch.exp(3 * torch.randn(count, generator=g))
    elif kind == "special" and count >= 8:
        x[::7] = float("nan")
        x[1::11] = float("inf")
        x[2::13] = -float("inf")
        x[3::17] = 0.0
        x[4::19] = -0.0
        x[5] = 1e-42  # subnormal
    elif kind == "beyond" and count >= 8:  # finite, but past float16's (or bfloat16's) range
        x[::9] = 1e5
        x[1::23] = -3.4e38
    elif kind == "constant":
        x = torch.full((count,), 0.375)
    elif kind == "levels":
        x = torch.randint(-3, 4, (count,), generator=g).float() * 0.25
    elif kind == "tiny":
        x = x * 1e-6
    return x


CASES = [
    # (count, k, sample, buckets, values, kind)
    (1, 2, 64, 2, torch.float32, "normal"),
    (7, 3, 64, 5, torch.float32, "normal"),
    (100, 16, 4096, 16, torch.float32, "normal"),
    (4096, 16, 4096, 64, torch.float32, "heavy"),
    (4097, 16, 4096, 16, torch.float32, "normal"),
    (50_000, 16, 4096, 16, torch.float32, "normal"),
    (50_000, 16, 4096, 61, torch.float16, "heavy"),
    (30_001, 5, 1000, 40, torch.bfloat16, "normal"),
    (20_000, 17, 2000, 17, torch.float32, "special"),
    (20_000, 8, 512, 100, torch.float16, "special"),
    (20_000, 4, 512, 9, torch.bfloat16, "special"),
    (20_000, 8, 512, 100, torch.float16, "beyond"),
    (20_000, 4, 512, 9, torch.bfloat16, "beyond"),
    (9_999, 200, 4096, 1000, torch.float32, "heavy"),
    (70_000, 256, 8192, 256, torch.float16, "normal"),
    (5_000, 16, 1024, 48, torch.float32, "constant"),
    (5_000, 32, 1024, 32, torch.float32, "levels"),
    (5_000, 16, 1024, 16, torch.bfloat16, "tiny"),
    (300, 2, 16, 65535, torch.float32, "normal"),
]


@pytest.mark.parametrize("count,k,sample,buckets,values,kind", CASES)
def test_torch_kernels_give_the_cores_bits_on_cpu(count, k, sample, buckets, values, kind):
    x = data(kind, count, seed=count + k)
    stream = _C.cluster_stream(7, 3, count)
    want_payload, want_residual = core_encode(x, k, sample, buckets, values, stream)
    got_payload, got_residual = torch_encode(x, k, sample, buckets, values, stream)
    assert torch.equal(got_payload, want_payload)
    assert torch.equal(got_residual.view(torch.int32), want_residual.view(torch.int32))
    for add in (False, True):
        base = data("normal", count, seed=1)
        want, got = base.clone(), base.clone()
        _C.cluster_decode(want_payload.data_ptr(), count, k, sample, buckets,
                          VALUE_CODES[values], want.data_ptr(), add)
        cluster_kernels.decode(want_payload, k, buckets, values, got, add)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_sample_indices_follow_the_cores_stream():
    # A block larger than the sample, whose values are their own indices: the centres can
    # only match if the same elements were drawn.
    count, sample = 1 << 20, 64
    x = torch.arange(count, dtype=torch.float32)
    for stream in (0, 1, (1 << 64) - 1, _C.cluster_stream(123, 9, 4096)):
        want, _ = core_encode(x, 2, sample, 2, torch.float32, stream)
        got, _ = torch_encode(x, 2, sample, 2, torch.float32, stream)
        assert torch.equal(got, want)


@pytest.mark.parametrize("run_values", [1 << 24, 4096])
def test_the_codec_encodes_a_chunk_as_the_cores_ring_does(monkeypatch, run_values):
    """Blocks of `segment` values from the chunk's start, each from its own stream; the torch
    kernels take runs of equal blocks as one batch (here all, or one block a batch)."""
    from fusionring.compression import cluster_codec

    monkeypatch.setattr(cluster_codec, "_RUN_VALUES", run_values)
    k, sample, buckets, values, seed, step = 16, 512, 16, torch.float16, 5, 11
    code = VALUE_CODES[values]
    at, count, segment = 3000, 14_000, 4096
    x = data("heavy", count, seed=3)
    want_parts, want_res, want_dec = [], [], []
    for first in range(0, count, segment):
        block = x[first:first + segment].clone()
        p, r = core_encode(block, k, sample, buckets, values,
                           _C.cluster_stream(seed, step, at + first))
        d = torch.empty(block.numel())
        _C.cluster_decode(p.data_ptr(), block.numel(), k, sample, buckets, code,
                          d.data_ptr(), False)
        want_parts.append(p)
        want_res.append(r)
        want_dec.append(d)
    decoded = torch.cat(want_dec)
    for on_device in (False, True):
        codec = ClusterCodec(k, sample, buckets, values, seed, step, segment, on_device)
        assert codec.payload_bytes(count) == sum(p.numel() for p in want_parts)
        payload = torch.zeros(codec.payload_bytes(count), dtype=torch.uint8)
        residual = torch.empty(count)
        codec.encode(x, at, payload, residual)
        assert torch.equal(payload, torch.cat(want_parts))
        assert torch.equal(residual, torch.cat(want_res))
        out = torch.ones(count)
        codec.decode_add(payload, out)
        assert torch.equal(out, 1 + decoded)
        codec.decode(payload, out)
        assert torch.equal(out, decoded)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("count,k,sample,buckets,values,kind", CASES)
def test_gpu_kernels_agree_with_the_core(count, k, sample, buckets, values, kind):
    """On a GPU the sample's prefix sums and the buckets' sums add in another order: the ids
    and tables must match; a mean may differ in its last bit."""
    x = data(kind, count, seed=count + k)
    stream = _C.cluster_stream(7, 3, count)
    want, want_residual = core_encode(x, k, sample, buckets, values, stream)
    got, got_residual = torch_encode(x.cuda(), k, sample, buckets, values, stream)
    got, got_residual = got.cpu(), got_residual.cpu()
    shape = cluster_kernels.layout(count, k, buckets, values)
    assert torch.equal(got[shape.nb_offset:], want[shape.nb_offset:])
    means_got = got[:shape.nb_offset].view(values).float()
    means_want = want[:shape.nb_offset].view(values).float()
    torch.testing.assert_close(means_got, means_want, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(got_residual, want_residual, rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    out = torch.empty(count, device="cuda")
    cluster_kernels.decode(want.cuda(), k, buckets, values, out, add=False)
    expect = torch.empty(count)
    _C.cluster_decode(want.data_ptr(), count, k, sample, buckets, VALUE_CODES[values],
                      expect.data_ptr(), False)
    assert torch.equal(out.cpu().view(torch.int32), expect.view(torch.int32))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_kernels_never_wait_for_the_host():
    """torch's sync debug mode raises on any operation that synchronizes with the host."""
    x = data("special", 100_000, seed=5).cuda()
    shape = cluster_kernels.layout(x.numel(), 16, 4096, 64, torch.float16)
    payload = torch.empty(shape.total, dtype=torch.uint8, device="cuda")
    residual = torch.empty_like(x)
    out = torch.zeros_like(x)
    torch.cuda.set_sync_debug_mode("error")
    try:
        cluster_kernels.encode(x, 16, 4096, 64, torch.float16, 12345, payload, residual)
        cluster_kernels.decode(payload, 16, 64, torch.float16, out, add=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.empty_like(x)
    cluster_kernels.decode(payload, 16, 64, torch.float16, ref, add=False)
    assert torch.equal(out, ref)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_compress_keeps_a_cuda_tensor_and_its_payload_on_the_gpu():
    from fusionring.compression import Compression

    on_gpu, on_host = Compression.cluster(k=8, sample=256), Compression.cluster(k=8, sample=256)
    x = data("heavy", 10_000, seed=9).reshape(100, 100)
    for _ in range(2):  # the second step adds the residual back
        payload, ctx = on_gpu.compress(x.cuda(), name="w")
        ref_payload, ref_ctx = on_host.compress(x, name="w")
        assert payload.is_cuda and payload.numel() == ref_payload.numel()
        out = on_gpu.decompress(payload, ctx)
        assert out.is_cuda and out.shape == x.shape
        torch.testing.assert_close(out.cpu(), on_host.decompress(ref_payload, ref_ctx),
                                   rtol=1e-5, atol=1e-6)
        total = torch.zeros(x.numel(), device="cuda")
        on_gpu.decode_add(payload, total)
        assert torch.equal(total.cpu().reshape(x.shape), out.cpu())
