"""alltoall, reducescatter and grouped allgather at several ranks, against local references.

Every rank rebuilds every rank's input from a seeded generator, so each can compute the
expected result with plain torch and compare it with what the collective returned.
"""
import pytest

from conftest import run_ranks

COLLECTIVES = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}

def check(label, fn):
    try:
        out[label] = bool(fn())
    except Exception as exc:  # recorded, so the test names the failing case
        out[label] = f"{type(exc).__name__}: {exc}"

def data(k, rows, shape, dtype, seed, low=-50, high=50):
    """Rank k's input: small integers, so float sums are exact in every dtype."""
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return torch.randint(low, high, (rows,) + shape, generator=g).to(dtype)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8]
bytes_before = hvd.communication_stats()["bytes_sent"]

# ------------------------------------------------------------------ alltoall
def even(dtype):
    inputs = [data(k, 2 * P, (3,), dtype, seed=1) for k in range(P)]
    got = hvd.alltoall(inputs[r], name=f"even.{dtype}")
    expect = torch.cat([inputs[k][2 * r:2 * r + 2] for k in range(P)])
    return got.dtype == dtype and torch.equal(got, expect)

for dtype in DTYPES:
    check(f"alltoall_even_{dtype}", lambda: even(dtype))

def splits_of(k):
    return [(k + 2 * j) % 3 for j in range(P)]  # uneven, with zeros

def uneven(dtype, as_tensor):
    inputs = [data(k, sum(splits_of(k)), (2, 3), dtype, seed=2) for k in range(P)]
    splits = torch.tensor(splits_of(r)) if as_tensor else splits_of(r)
    got, received = hvd.alltoall(inputs[r], splits=splits, name=f"uneven.{dtype}.{as_tensor}")
    rows = [splits_of(k)[r] for k in range(P)]
    starts = [sum(splits_of(k)[:r]) for k in range(P)]
    expect = torch.cat([inputs[k][starts[k]:starts[k] + rows[k]] for k in range(P)])
    split_dtype = torch.int64 if as_tensor else torch.int32
    return (torch.equal(got, expect) and got.shape[1:] == (2, 3)
            and received.tolist() == rows and received.dtype == split_dtype)

for dtype in (torch.int64, torch.float32, torch.float16):
    check(f"alltoall_uneven_{dtype}", lambda: uneven(dtype, as_tensor=False))
check("alltoall_uneven_tensor_splits", lambda: uneven(torch.int32, as_tensor=True))

def nothing_from_rank0():
    # rank 0 sends no rows at all; the others send rank j one row
    x = torch.zeros((0, 4)) if r == 0 else torch.full((P, 4), float(r))
    splits = [0] * P if r == 0 else [1] * P
    got, received = hvd.alltoall(x, splits=splits, name="empty_sender")
    expect = torch.cat([torch.full((1, 4), float(k)) for k in range(1, P)])
    return torch.equal(got, expect) and received.tolist() == [0] + [1] * (P - 1)

check("alltoall_empty_sender", nothing_from_rank0)

def alltoall_async():
    x = data(r, 3 * P, (), torch.float64, seed=3)
    h = hvd.alltoall_async(x)  # unnamed
    while not hvd.poll(h):
        pass
    got, received = hvd.synchronize(h)
    expect = torch.cat([data(k, 3 * P, (), torch.float64, seed=3)[3 * r:3 * r + 3]
                        for k in range(P)])
    return torch.equal(got, expect) and received.tolist() == [3] * P

check("alltoall_async", alltoall_async)

def alltoall_grad():
    x = data(r, sum(splits_of(r)), (2,), torch.float32, seed=4).requires_grad_(True)
    y, _ = hvd.alltoall(x, splits=splits_of(r), name="grad")
    (y * (r + 1)).sum().backward()  # rows sent to rank j get gradient j + 1
    expect = torch.cat([torch.full((n, 2), float(j + 1)) for j, n in enumerate(splits_of(r))])
    return torch.equal(x.grad, expect)

check("alltoall_grad", alltoall_grad)

def bad_splits():
    x = torch.zeros(2 * P, 2)
    cases = {"length": [2] * (P - 1) + [0, 2],
             "negative": [-1, 2 * P + 1] + [0] * (P - 2),
             "sum": [1] * P,
             "float": torch.ones(P) * 2}
    messages = {}
    for label, splits in cases.items():
        try:
            hvd.alltoall(x, splits=splits, name="bad")
            messages[label] = None
        except ValueError as exc:
            messages[label] = str(exc)
    try:
        hvd.alltoall(torch.zeros(2 * P + 1, 2), name="bad")
        messages["indivisible"] = None
    except ValueError as exc:
        messages["indivisible"] = str(exc)
    out["bad_splits_messages"] = messages
    works = torch.equal(hvd.alltoall(torch.full((P,), float(r)), name="bad"),
                        torch.arange(P, dtype=torch.float32))
    return works and all(m is not None and "'bad'" in m for m in messages.values())

check("alltoall_bad_splits", bad_splits)

# ------------------------------------------------------------------ reducescatter
def block(n):
    """Horovod's rule: n // P rows each, one more for the first n % P ranks."""
    base, extra = divmod(n, P)
    sizes = [base + (1 if k < extra else 0) for k in range(P)]
    return sum(sizes[:r]), sizes[r]

TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 1e-2}

def expected_reduction(inputs, op, pre=1.0, post=1.0):
    stacked = torch.stack([t.double() * pre for t in inputs])
    if op == hvd.Max:
        total = stacked.max(0).values
    elif op == hvd.Min:
        total = stacked.min(0).values
    elif op == hvd.Product:
        total = stacked.prod(0)
    else:
        total = stacked.sum(0)
    total = total * post * (1.0 / P if op == hvd.Average else 1.0)
    dtype = inputs[0].dtype
    return total.trunc().to(dtype) if not dtype.is_floating_point else total.to(dtype)

def close(got, expect):
    if got.dtype != expect.dtype or got.shape != expect.shape:
        return False
    if not got.dtype.is_floating_point:
        return torch.equal(got, expect)
    return torch.allclose(got.double(), expect.double(), rtol=TOL[got.dtype], atol=0)

def reducescatter_case(dtype, n, op, seed, low=-50, high=50, pre=1.0, post=1.0):
    inputs = [data(k, n, (3,), dtype, seed, low, high) for k in range(P)]
    got = hvd.reducescatter(inputs[r], name=f"rs.{dtype}.{n}.{int(op)}.{pre}", op=op,
                            prescale_factor=pre, postscale_factor=post)
    start, rows = block(n)
    return close(got, expected_reduction(inputs, op, pre, post)[start:start + rows])

for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
              torch.bfloat16):
    for n in (2 * P, 2 * P + 1, 1):  # divisible, not divisible, fewer rows than ranks
        for op in (hvd.Sum, hvd.Average):
            check(f"reducescatter_{dtype}_{n}_{op.name}",
                  lambda: reducescatter_case(dtype, n, op, seed=5))
check("reducescatter_max_int32", lambda: reducescatter_case(torch.int32, P + 1, hvd.Max, 6))
check("reducescatter_min_float32", lambda: reducescatter_case(torch.float32, 5, hvd.Min, 7))
check("reducescatter_product_float64",
      lambda: reducescatter_case(torch.float64, 4, hvd.Product, 8, low=-2, high=3))
check("reducescatter_scaled",
      lambda: reducescatter_case(torch.float64, 2 * P + 1, hvd.Sum, 9, pre=0.5, post=3.0))
check("reducescatter_scaled_float16",
      lambda: reducescatter_case(torch.float16, P, hvd.Average, 10, pre=2.0, post=0.5))

def reducescatter_random_floats():
    g = torch.Generator().manual_seed(11)
    inputs = [torch.randn(5 * P + 2, 4, generator=g) for _ in range(P)]
    got = hvd.reducescatter(inputs[r], name="randn")  # default op: Average
    start, rows = block(5 * P + 2)
    expect = (torch.stack(inputs).double().sum(0) / P)[start:start + rows]
    return torch.allclose(got.double(), expect, rtol=1e-5, atol=1e-6)

check("reducescatter_random_floats", reducescatter_random_floats)

def reducescatter_async():
    inputs = {n: [data(k, n, (2,), torch.int64, seed=12) for k in range(P)] for n in (P, 3 * P + 2)}
    handles = {n: hvd.reducescatter_async(inputs[n][r], name=f"async.{n}", op=hvd.Sum)
               for n in inputs}
    ok = True
    for n, h in handles.items():
        start, rows = block(n)
        ok = ok and torch.equal(hvd.synchronize(h),
                                expected_reduction(inputs[n], hvd.Sum)[start:start + rows])
    return ok

check("reducescatter_async", reducescatter_async)

def grouped_reducescatter():
    a = [data(k, 2 * P + 1, (2,), torch.float32, seed=13) for k in range(P)]
    b = [data(k, P, (), torch.int64, seed=14) for k in range(P)]
    got = hvd.grouped_reducescatter([a[r], b[r]], name="grp", op=hvd.Sum)
    got_async = hvd.synchronize(hvd.grouped_reducescatter_async([a[r], b[r]], op=hvd.Average))
    (sa, na), (sb, nb) = block(2 * P + 1), block(P)
    return (len(got) == 2
            and close(got[0], expected_reduction(a, hvd.Sum)[sa:sa + na])
            and close(got[1], expected_reduction(b, hvd.Sum)[sb:sb + nb])
            and close(got_async[0], expected_reduction(a, hvd.Average)[sa:sa + na])
            and close(got_async[1], expected_reduction(b, hvd.Average)[sb:sb + nb]))

check("grouped_reducescatter", grouped_reducescatter)

def reducescatter_grad(op):
    n = 2 * P + 1
    x = torch.ones(n, 2, requires_grad=True)
    y = hvd.reducescatter(x, op=op)
    (y * (r + 1)).sum().backward()  # rank j's block gets gradient (j + 1)
    scale = 1.0 if op == hvd.Average else float(P)  # Horovod's scaling: P for Sum, 1 for Average
    base, extra = divmod(n, P)
    expect = torch.cat([torch.full((base + (1 if j < extra else 0), 2), (j + 1) * scale)
                        for j in range(P)])
    return torch.allclose(x.grad, expect)

check("reducescatter_grad_sum", lambda: reducescatter_grad(hvd.Sum))
check("reducescatter_grad_average", lambda: reducescatter_grad(hvd.Average))

def reducescatter_fp16_compression():
    x = torch.full((P, 2), float(r) + 0.5)
    got = hvd.reducescatter(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    return got.dtype == torch.float32 and torch.equal(
        got, torch.full((1, 2), sum(k + 0.5 for k in range(P))))

check("reducescatter_fp16_compression", reducescatter_fp16_compression)

def reducescatter_scalar_refused():
    try:
        hvd.reducescatter(torch.tensor(1.0), name="scalar")
    except ValueError as exc:
        return "'scalar'" in str(exc)
    return False

check("reducescatter_scalar_refused", reducescatter_scalar_refused)

# ------------------------------------------------------------------ grouped allgather
def grouped_allgather():
    def mine(k):
        return [data(k, k + 1, (2,), torch.float32, seed=15),
                data(k, 2 * k, (), torch.int64, seed=16),      # no rows on rank 0
                data(k, 3, (2, 2), torch.float16, seed=17)]
    got = hvd.grouped_allgather(mine(r), name="gag")
    h = hvd.grouped_allgather_async(mine(r))
    while not hvd.poll(h):
        pass
    got_async = hvd.synchronize(h)
    expect = [torch.cat([mine(k)[i] for k in range(P)]) for i in range(3)]
    return all(torch.equal(g, e) and g.dtype == e.dtype
               for g, e in zip(got + got_async, expect + expect))

check("grouped_allgather", grouped_allgather)

def many_allgathers():
    # Submitted together, small ones travel in one fused collective; the 4 MiB one alone.
    shapes = [(), (3,), (2, 2)]
    def mine(k, i):
        rows = (i + k) % 3 if i % 5 else 0 if k == 0 else 1   # some ranks send no rows
        big = i == 150
        return data(k, (1 << 20) if big else rows, () if big else shapes[i % 3],
                    DTYPES[i % len(DTYPES)], seed=100 + i)
    handles = [hvd.allgather_async(mine(r, i), name=f"many.{i}") for i in range(300)]
    got = [hvd.synchronize(h) for h in reversed(handles)][::-1]
    return all(torch.equal(g, torch.cat([mine(k, i) for k in range(P)]))
               and g.dtype == mine(r, i).dtype for i, g in enumerate(got))

check("grouped_allgather_many", many_allgathers)

def grouped_allgather_grad():
    x = torch.ones(r + 1, 2, requires_grad=True)
    z = torch.ones(2, requires_grad=True)
    gx, gz = hvd.grouped_allgather([x, z], name="gag_grad")
    ((gx * (r + 1)).sum() + gz.sum()).backward()  # gradient averaged over the ranks' losses
    return (torch.allclose(x.grad, torch.full((r + 1, 2), (P + 1) / 2))
            and torch.equal(z.grad, torch.full((2,), 1.0)))

check("grouped_allgather_grad", grouped_allgather_grad)
check("grouped_empty", lambda: hvd.grouped_allgather([]) == []
      and hvd.grouped_reducescatter([]) == [])

# ------------------------------------------------------------------ mismatches
def mismatch(label, fn):
    try:
        fn()
        out[label] = None
    except hvd.TensorMismatchError as exc:
        out[label] = str(exc)

last = P - 1
mismatch("mm_alltoall_dtype", lambda: hvd.alltoall(
    torch.zeros(P, 2, dtype=torch.float64 if r == last else torch.float32), name="mixed"))
mismatch("mm_alltoall_shape", lambda: hvd.alltoall(torch.zeros(P, 3 if r == 0 else 4),
                                                   name="cols"))
mismatch("mm_reducescatter_dtype", lambda: hvd.reducescatter(
    torch.zeros(P, dtype=torch.int32 if r == last else torch.float32), name="mixed_rs"))
mismatch("mm_reducescatter_dim0", lambda: hvd.reducescatter(torch.zeros(P + (r == 0), 2),
                                                            name="rows"))
mismatch("mm_reducescatter_op", lambda: hvd.reducescatter(
    torch.zeros(P), name="ops", op=hvd.Sum if r == 0 else hvd.Average))
mismatch("mm_grouped_allgather", lambda: hvd.grouped_allgather(
    [torch.zeros(1), torch.zeros(1, dtype=torch.int64 if r == 0 else torch.int32)], name="gm"))
# Tensors torch calls contiguous whose stride is not 1: an empty one made from numpy (stride
# 0) and a one-element view with stride 0.
import numpy as np
empty = torch.tensor(np.zeros(0))
check("odd_strides_allgather", lambda: torch.equal(
    hvd.allgather(empty if r == P - 1 else torch.full((2,), float(r), dtype=torch.float64),
                  name="odd_gather"),
    torch.tensor([float(k) for k in range(P - 1) for _ in range(2)], dtype=torch.float64)))
single = torch.tensor([float(r + 1)]).as_strided((1,), (0,))
check("odd_strides_one_element", lambda: hvd.allreduce(single, name="odd_sum", op=hvd.Sum).item()
      == P * (P + 1) / 2 and hvd.broadcast(single, root_rank=P - 1, name="odd_bc").item() == P)
sparse = (torch.sparse_coo_tensor(torch.tensor(np.zeros((2, 0), dtype=np.int64)), empty, (3, 3))
          if r == P - 1 else torch.sparse_coo_tensor([[0], [r % 3]], [1.0], (3, 3),
                                                     dtype=torch.float64))
expected_sparse = np.zeros((3, 3))
for k in range(P - 1):
    expected_sparse[0, k % 3] += 1.0
check("odd_strides_sparse", lambda: np.array_equal(
    hvd.sparse_allreduce_async(sparse, name="odd_sparse", op=hvd.Sum)().to_dense().numpy(),
    expected_sparse))
# still usable, under the names that failed
check("after_mismatch", lambda: torch.equal(
    hvd.alltoall(torch.full((P, 2), float(r)), name="mixed"),
    torch.arange(P, dtype=torch.float32).repeat_interleave(2).reshape(P, 2))
    and torch.equal(hvd.reducescatter(torch.ones(P), name="mixed_rs", op=hvd.Sum),
                    torch.full((1,), float(P))))

out["bytes_sent_grew"] = hvd.communication_stats()["bytes_sent"] > bytes_before
out["size"] = P
report(out)
'''


@pytest.fixture(scope="module", params=[2, 3, 4])
def results(request, tmp_path_factory):
    return run_ranks(request.param, COLLECTIVES, tmp_path_factory.mktemp("collectives"),
                     timeout=120)


def _failed(results, prefix):
    failed = []
    for rank, out in enumerate(results):
        failed += [(rank, k, v) for k, v in out.items() if k.startswith(prefix) and v is not True]
    return failed


def test_alltoall_matches_reference(results):
    assert all(any(k.startswith("alltoall_uneven") for k in out) for out in results)
    assert _failed(results, "alltoall_") == []


def test_alltoall_bad_splits_raise_value_error_naming_the_tensor(results):
    P = results[0]["size"]
    for out in results:
        messages = out["bad_splits_messages"]
        assert f"splits has {P + 1} entries" in messages["length"]
        assert "negative" in messages["negative"]
        assert f"sum to {P}, but the first dimension is {2 * P}" in messages["sum"]
        assert "1-D integer tensor" in messages["float"]
        assert "does not split evenly" in messages["indivisible"]


def test_reducescatter_matches_reference(results):
    assert _failed(results, "reducescatter") == []
    assert _failed(results, "grouped_reducescatter") == []


def test_tensors_with_stride_zero_travel(results):
    assert _failed(results, "odd_strides") == []


def test_grouped_allgather_matches_reference(results):
    assert _failed(results, "grouped_allgather") + _failed(results, "grouped_empty") == []


def test_mismatch_raises_on_every_rank_and_library_keeps_working(results):
    P = results[0]["size"]
    last = P - 1
    others = "rank 0" if P == 2 else "ranks " + ", ".join(str(k) for k in range(last))
    for out in results:
        assert out["mm_alltoall_dtype"] == (f"alltoall 'mixed': {others} sent dtype float32, "
                                            f"rank {last} sent float64")
        assert "alltoall 'cols'" in out["mm_alltoall_shape"]
        assert "shape (all but the first dimension)" in out["mm_alltoall_shape"]
        assert "rank 0 sent shape (all but the first dimension) [3]" in out["mm_alltoall_shape"]
        assert "reducescatter 'mixed_rs'" in out["mm_reducescatter_dtype"]
        assert f"rank {last} sent int32" in out["mm_reducescatter_dtype"]
        assert "reducescatter 'rows'" in out["mm_reducescatter_dim0"]
        assert f"rank 0 sent shape [{P + 1}, 2]" in out["mm_reducescatter_dim0"]
        assert "'ops'" in out["mm_reducescatter_op"] and "Average" in out["mm_reducescatter_op"]
        assert "allgather 'gm.1'" in out["mm_grouped_allgather"]
        assert out["after_mismatch"] is True
        assert out["bytes_sent_grew"] is True
    for key in [k for k in results[0] if k.startswith("mm_")]:
        assert len({out[key] for out in results}) == 1  # the same message on every rank


BYTES_SENT = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()

def sent(run):
    before = hvd.communication_stats()["bytes_sent"]
    run()
    return hvd.communication_stats()["bytes_sent"] - before

out = {
    "allreduce": sent(lambda: hvd.allreduce(torch.ones(1 << 18), name="ar")),
    "allgather": sent(lambda: hvd.allgather(torch.ones(r + 1, 1024), name="ag")),
    "broadcast": sent(lambda: hvd.broadcast(torch.ones(1024), root_rank=1, name="bc")),
    "alltoall": sent(lambda: hvd.alltoall(torch.ones(2 * P, 256), name="a2a")),
}
report(out)
hvd.shutdown()
'''


def test_bytes_sent_counts_what_each_collective_sends_to_other_ranks(tmp_path):
    """One definition throughout: a rank's own part never counts, a broadcast counts once, at
    its root (allgather counted the rank's own rows, broadcast counted on every rank)."""
    P = 3
    for r, out in enumerate(run_ranks(P, BYTES_SENT, tmp_path)):
        assert out["allreduce"] == 4 * (1 << 18) * 2 * (P - 1) // P, out
        assert out["allgather"] == 4 * 1024 * (sum(range(1, P + 1)) - (r + 1)), out
        assert out["broadcast"] == (4 * 1024 if r == 1 else 0), out
        assert out["alltoall"] == 4 * 256 * 2 * (P - 1), out
