"""The core's buffer kernels against numpy/torch references, in one process."""
import numpy as np
import pytest
import torch

from fusionring import _C
from fusionring.dtypes import DTYPE_CODES

OPS = {"sum": 0, "min": 1, "max": 2, "product": 3}
REFERENCE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum, "product": torch.mul}


def _random(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    high = 4 if dtype == torch.uint8 else 50
    return torch.randint(0 if dtype == torch.uint8 else -high, high, (n,), generator=g,
                         dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 1000])
def test_reduce_into_matches_torch(dtype, op, n):
    a, b = _random(dtype, n, 1), _random(dtype, n, 2)
    expected = REFERENCE[op](a.float() if dtype in (torch.float16, torch.bfloat16) else a,
                             b.float() if dtype in (torch.float16, torch.bfloat16) else b)
    expected = expected.to(dtype)
    out = a.clone()
    _C.reduce_into(out.data_ptr(), b.data_ptr(), n, DTYPE_CODES[dtype], OPS[op])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_conversions_round_like_torch(dtype):
    # Every 16-bit pattern through float32 and back via the core's sum with zero.
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = bits[torch.isfinite(bits.float())]
    zeros = torch.zeros_like(finite)
    out = finite.clone()
    _C.reduce_into(out.data_ptr(), zeros.data_ptr(), out.numel(), DTYPE_CODES[dtype], 0)
    assert torch.equal(out.float(), (finite.float() + 0.0).to(dtype).float())
    # Rounding of float32 values that fall between 16-bit values.
    x = torch.randn(100000, dtype=torch.float64).to(torch.float32) * 100
    half = x.to(dtype)
    acc = torch.zeros(100000, dtype=dtype)
    other = x.to(dtype)
    _C.reduce_into(acc.data_ptr(), other.data_ptr(), acc.numel(), DTYPE_CODES[dtype], 0)
    assert torch.equal(acc, half)


@pytest.mark.parametrize("dtype", list(DTYPE_CODES))
def test_scale_in_place(dtype):
    x = _random(dtype, 333, 3)
    out = x.clone()
    _C.scale(out.data_ptr(), out.numel(), DTYPE_CODES[dtype], 0.25)
    if dtype.is_floating_point:
        expected = (x.float() * 0.25).to(dtype) if dtype != torch.float64 else x * 0.25
        assert torch.equal(out, expected)
    else:
        assert torch.equal(out, (x.double() * 0.25).trunc().to(dtype))


def test_pack_unpack_round_trip():
    tensors = [torch.randn(n) for n in (0, 1, 17, 1000)]
    sizes = [t.numel() * 4 for t in tensors]
    buffer = torch.empty(sum(t.numel() for t in tensors))
    written = _C.pack([t.data_ptr() for t in tensors], sizes, buffer.data_ptr())
    assert written == sum(sizes)
    assert torch.equal(buffer, torch.cat(tensors))
    outs = [torch.empty_like(t) for t in tensors]
    _C.unpack(buffer.data_ptr(), [o.data_ptr() for o in outs], sizes)
    for o, t in zip(outs, tensors):
        assert torch.equal(o, t)


def test_invalid_codes_raise_value_error():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="dtype"):
        _C.reduce_into(x.data_ptr(), x.data_ptr(), 4, 99, 0)
    with pytest.raises(ValueError, match="op"):
        _C.reduce_into(x.data_ptr(), x.data_ptr(), 4, 0, 42)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 1000003])
def test_sum_squares_matches_numpy_in_double(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 5).to(dtype)
    expected = float(np.sum(x.double().numpy() ** 2))
    got = _C.sum_squares(x.data_ptr(), x.numel(), DTYPE_CODES[dtype])
    assert got == pytest.approx(expected, rel=1e-12, abs=0.0)
