"""Ring allreduce against numpy at 1-4 ranks: every dtype, op and awkward size."""
import pytest

from conftest import run_ranks

CASES = r'''
import numpy as np, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import _C
from fusionring.dtypes import DTYPE_CODES

hvd.init()
comm = MPI.COMM_WORLD
rank, size = hvd.rank(), hvd.size()
core = _C.Communicator(MPI._handleof(comm.Dup()))
# A tiny slot: buffers over 1024 float32 take several pieces.
shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 4096) if size > 1 else None
SIZES = [0, 1, 2, size - 1, size + 1, 7, 17, 1021, 40009]
OPS = {"Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product,
       "Average": hvd.Average}

def data(dtype, n, r, op):
    g = torch.Generator().manual_seed(1000 * r + n)
    if op == "Product":
        vals = torch.randint(0, 3, (n,), generator=g) - 1  # -1, 0, 1: exact in every dtype
        vals[vals == 0] = 1
        return vals.to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1).to(dtype)
    lo = 0 if dtype == torch.uint8 else -40
    hi = 40
    if dtype == torch.int8:  # sums of 4 ranks stay inside int8
        lo, hi = -20, 20
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)

def reference(dtype, n, op):
    xs = [data(dtype, n, r, op).double() for r in range(size)]
    if op in ("Sum", "Average"):
        out = sum(xs)
        if op == "Average":
            out = out / size
    elif op == "Min":
        out = torch.stack(xs).min(0).values if n else xs[0]
    elif op == "Max":
        out = torch.stack(xs).max(0).values if n else xs[0]
    else:
        out = torch.stack(xs).prod(0) if n else xs[0]
    if dtype == torch.uint8 and op == "Sum":  # wraps modulo 256
        out = torch.remainder(sum(x.long() for x in xs), 256).double()
    if dtype == torch.uint8 and op == "Product" and n:
        out = torch.remainder(torch.stack([x.long() for x in xs]).prod(0), 256).double()
    return out

failures = []
def check(label, got, dtype, n, op):
    ref = reference(dtype, n, op)
    got64 = got.double()
    if dtype in (torch.float16, torch.bfloat16):
        tol = (2e-2 if dtype == torch.float16 else 8e-2) * size
        ok = torch.allclose(got64, ref, atol=tol, rtol=tol)
    elif dtype.is_floating_point:
        ok = torch.allclose(got64, ref, atol=1e-5, rtol=1e-5)
    elif op == "Average":
        ok = torch.equal(got64, torch.trunc(reference(dtype, n, "Sum") / size)) if dtype != torch.uint8 else True
    else:
        ok = torch.equal(got64, ref)
    # Every rank must hold the very same bits.
    same = len(set(comm.allgather(got.contiguous().view(torch.uint8).numpy().tobytes()))) == 1
    if not ok or not same:
        failures.append(f"{label} {dtype} n={n} op={op} ok={ok} identical={same}")

for dtype in DTYPE_CODES:
    for op in OPS:
        for n in SIZES:
            x = data(dtype, n, rank, op)
            # The user API.
            got = hvd.allreduce(x, name=f"{dtype}.{op}.{n}", op=OPS[op])
            check("api", got, dtype, n, op)
            if op == "Average":
                continue
            # The core directly, forcing each algorithm.
            code = {"Sum": 0, "Min": 1, "Max": 2, "Product": 3}[op]
            for algorithm in ("ring", "recursive_doubling"):
                y = x.clone()
                core.allreduce(y.data_ptr(), n, DTYPE_CODES[dtype], code, 1.0, 1.0, 4096, 0,
                               algorithm)
                check(algorithm, y, dtype, n, op)
            if shm is not None:
                # Several buffers reduced as one, as a fused batch is.
                y = x.clone()
                parts = list(torch.tensor_split(y, 3))
                shm.allreduce([p.data_ptr() for p in parts],
                              [p.numel() * p.element_size() for p in parts],
                              DTYPE_CODES[dtype], code, 1.0, 1.0, 0.0)
                check("shared_memory", y, dtype, n, op)

# Prescale / postscale compose with Average exactly as documented: (sum(pre*x)/size)*post.
x = data(torch.float64, 1000, rank, "Sum")
got = hvd.allreduce(x, name="scaled", op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5)
if not torch.allclose(got, reference(torch.float64, 1000, "Sum") / size, atol=1e-12):
    failures.append("prescale/postscale")
report(failures)
'''

# The same through the runtime with every dense allreduce on the shared-memory window.
SHARED_MEMORY_ENV = {"FUSIONRING_SHARED_MEMORY": "on", "FUSIONRING_SHM_SLOT_BYTES": "4096",
                     "FUSIONRING_SMALL_MESSAGE_BYTES": "0"}


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_allreduce_matches_numpy_for_every_dtype_op_and_size(np_, tmp_path):
    results = run_ranks(np_, CASES, tmp_path, timeout=240)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"


@pytest.mark.parametrize("np_", [2, 3])
def test_shared_memory_transport_matches_numpy(np_, tmp_path):
    code = CASES.replace("hvd.init()", "hvd.init()\nfrom fusionring import state as _rt\nassert _rt.get().shared_memory")
    results = run_ranks(np_, code, tmp_path, timeout=240, env=SHARED_MEMORY_ENV)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"


TWO_RANK_TRANSPORT = r'''
import json, os, torch
import fusionring.torch as hvd
from fusionring import state as _rt
from fusionring.runtime import Request
from fusionring.scheduler import PLAN, SINGLE, THRESHOLD
hvd.init()
rt = _rt.get()
if not rt.shared_memory:
    report("no window")  # fewer cores than ranks: auto leaves the window off
else:
    def requests(*sizes):
        return [Request(f"t{i}", None, torch.empty(n // 4), None) for i, n in enumerate(sizes)]
    rule = {
        "one tensor": rt._through_shared_memory(requests(1 << 20), SINGLE),
        "plan group": rt._through_shared_memory(requests(1 << 19, 1 << 19), PLAN),
        "threshold batch": rt._through_shared_memory(requests(1 << 19, 1 << 19), THRESHOLD),
        "small threshold batch": rt._through_shared_memory(requests(1024, 1024), THRESHOLD),
    }
    path = os.path.join(os.environ["FR_TEST_OUT"], "timeline.json")
    hvd.start_timeline(path)
    x = torch.full((1 << 18,), float(hvd.rank() + 1))
    y = hvd.allreduce(x, name="single", op=hvd.Sum)
    hvd.stop_timeline()
    transports = []
    if hvd.rank() == 0:
        events = json.load(open(path))
        events = events["traceEvents"] if isinstance(events, dict) else events
        transports = [e["args"].get("transport", "ring") for e in events
                      if e["name"] in ("RING_ALLREDUCE", "SHM_ALLREDUCE")]
    report({"rule": rule, "transports": transports, "sum_ok": bool(torch.all(y == 3.0))})
'''


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_two_ranks_use_the_window_only_where_it_saves_the_pack(mode, tmp_path):
    results = run_ranks(2, TWO_RANK_TRANSPORT, tmp_path, timeout=90,
                        env={"FUSIONRING_SHARED_MEMORY": mode})
    if results[0] == "no window":
        assert mode == "auto"
        pytest.skip("fewer cores than ranks: auto keeps the ring")
    on = mode == "on"
    expected = {"one tensor": on, "plan group": on, "threshold batch": True,
                "small threshold batch": False}
    for result in results:
        assert result["rule"] == expected and result["sum_ok"]
    assert results[0]["transports"] == ["shared memory" if on else "ring"]


@pytest.mark.parametrize("np_", [3])
def test_sleeping_waits_match_numpy(np_, tmp_path):
    # The wait policy used across a network: test, then nap between tests (negotiation too).
    code = CASES.replace("hvd.init()", "hvd.init()\nfrom fusionring import state as _rt\n"
                         "assert _rt.get().mpi_wait == 'sleep'").replace(
        "shm = _C.SharedMemoryAllreduce", "core.set_wait_policy(0, 20)\n"
        "shm = _C.SharedMemoryAllreduce")
    results = run_ranks(np_, code, tmp_path, timeout=240,
                        env={"FUSIONRING_MPI_WAIT": "sleep", "FUSIONRING_SHARED_MEMORY": "off"})
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"


SPIN_BUDGET = r'''
import time
import numpy as np
from mpi4py import MPI
from fusionring import _C

comm = MPI.COMM_WORLD
core = _C.Communicator(MPI._handleof(comm))
core.set_wait_policy(5000, 1000)
words = np.full(4, (1 << 64) - 1, dtype=np.uint64)
after = []
for i in range(4):
    if comm.rank == 1:
        time.sleep(0.05)  # rank 0 waits 50 ms for a late peer
    words[:] = (1 << 64) - 1 - (comm.rank << i)
    core.band_allreduce(words.ctypes.data, 4)
    assert int(words[0]) == ((1 << 64) - 1) & ~(1 << i), int(words[0])
    after.append(core.spin_budget_us)
for _ in range(20):
    core.band_allreduce(words.ctypes.data, 4)
prompt = core.spin_budget_us
core.set_wait_policy(5000, 1000)
report({"late": after, "prompt": prompt, "reset": core.spin_budget_us})
'''


def test_spin_budget_halves_on_a_late_peer_and_resets_with_the_policy(tmp_path):
    results = run_ranks(2, SPIN_BUDGET, tmp_path, timeout=90)
    # Each 50 ms wait outlasts the budget and halves it; prompt waits move it by a step at most.
    assert results[0]["late"] == [2500, 1250, 625, 312]
    assert 250 <= results[0]["prompt"] <= 625
    assert results[0]["reset"] == results[1]["reset"] == 5000


def test_wait_policy_rejects_bad_values():
    from mpi4py import MPI
    from fusionring import _C

    core = _C.Communicator(MPI._handleof(MPI.COMM_SELF))
    with pytest.raises(ValueError, match="wait policy"):
        core.set_wait_policy(-1, 10)


COMPLEX = r'''
import numpy as np, torch
import fusionring.torch as hvd
from fusionring.exceptions import TensorMismatchError
hvd.init()
rank, size = hvd.rank(), hvd.size()

def data(r, dtype, shape):
    rng = np.random.default_rng(7 + r)
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(
        np.complex64 if dtype == torch.complex64 else np.complex128)

def ref(dtype, shape, op="Average"):
    total = sum(data(r, dtype, shape).astype(np.complex128) for r in range(size))
    return total / size if op == "Average" else total

def same(got, want, dtype):
    return bool(np.allclose(got.numpy(), want, atol=1e-5 if dtype == torch.complex64 else 1e-12))

out = {}
for dtype in (torch.complex64, torch.complex128):
    label = str(dtype).replace("torch.", "")
    x = torch.from_numpy(data(rank, dtype, (17, 3)))
    out[label + " average"] = same(hvd.allreduce(x, name=label), ref(dtype, (17, 3)), dtype)
    out[label + " sum, scaled"] = same(
        hvd.allreduce(x, name=label + ".s", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
        ref(dtype, (17, 3), "Sum") * 0.5, dtype)
    y = x.clone()
    hvd.allreduce_(y, name=label + ".inplace", op=hvd.Sum)
    out[label + " in place"] = y.dtype == dtype and same(y, ref(dtype, (17, 3), "Sum"), dtype)
    t = x.clone().t()  # not contiguous: reduced through a copy, written back
    hvd.allreduce_(t, name=label + ".t")
    out[label + " transposed"] = same(t, ref(dtype, (17, 3)).T, dtype)
    a, b = hvd.grouped_allreduce([x, x[0, 0]], name=label + ".g")  # a 0-d one too
    out[label + " grouped"] = same(a, ref(dtype, (17, 3)), dtype) and \
        same(b, ref(dtype, (17, 3))[0, 0], dtype)
    rs = hvd.reducescatter(x, name=label + ".rs", op=hvd.Sum)
    base, extra = divmod(17, size)
    start = rank * base + min(rank, extra)
    out[label + " reducescatter"] = same(rs, ref(dtype, (17, 3), "Sum")[start:start + len(rs)],
                                         dtype)

# Autograd: the gradient of a sum over ranks is the output gradient summed over ranks.
w = torch.from_numpy(data(rank, torch.complex64, (5,))).requires_grad_()
hvd.allreduce(w, name="grad", op=hvd.Sum).real.sum().backward()
out["grad"] = bool(torch.allclose(w.grad, torch.full((5,), float(size), dtype=torch.complex64)))

# DistributedOptimizer on a complex layer: every rank ends with the same weights, those of
# one process stepping on the average of every rank's gradient.
torch.manual_seed(0)
layer = torch.nn.Linear(3, 2, dtype=torch.complex64)
single = torch.nn.Linear(3, 2, dtype=torch.complex64)
single.load_state_dict(layer.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1),
                               named_parameters=layer.named_parameters())
ref_opt = torch.optim.SGD(single.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    layer(torch.from_numpy(data(rank + 10 * step, torch.complex64, (4, 3)))).abs().sum().backward()
    opt.step()
    ref_opt.zero_grad()
    sum(single(torch.from_numpy(data(r + 10 * step, torch.complex64, (4, 3)))).abs().sum()
        for r in range(size)).div(size).backward()
    ref_opt.step()
out["optimizer"] = bool(torch.allclose(layer.weight, single.weight, atol=1e-6))

# N:M compresses a complex tensor as its parts: the same as compressing the real view.
for shared in (True, False):
    on_complex, on_parts = (hvd.Compression.nm(shared_mask=shared) for _ in range(2))
    same_bits = True
    for step in range(3):
        z = torch.from_numpy(data(rank + 10 * step, torch.complex64, (40,)))
        a = hvd.allreduce(z, name="nm.c", compression=on_complex)
        b = hvd.allreduce(torch.view_as_real(z).clone(), name="nm.r", compression=on_parts)
        same_bits &= a.dtype == torch.complex64 and torch.equal(torch.view_as_real(a), b)
    out[f"nm shared_mask={shared}"] = bool(same_bits)

errors = {}
for op in (hvd.Max, hvd.Min, hvd.Product, hvd.Adasum):
    try:
        hvd.allreduce(x, name="bad", op=op)
    except ValueError as e:
        errors[op.name] = str(e)
try:  # one rank complex, the other its real view: caught before anything moves
    hvd.allreduce(x if rank == 0 else torch.view_as_real(x), name="mixed")
except TensorMismatchError as e:
    errors["mixed"] = str(e)
out["after errors"] = same(hvd.allreduce(x, name="again"), ref(torch.complex128, (17, 3)),
                           torch.complex128)
report({"out": out, "errors": errors})
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_complex_tensors_reduce_as_their_parts(np_, tmp_path):
    for result in run_ranks(np_, COMPLEX, tmp_path, timeout=120):
        assert all(result["out"].values()), result["out"]
        errors = result["errors"]
        for op in ("Max", "Min", "Product"):
            assert f"op={op} is not defined for complex tensors (complex128)" in errors[op]
        assert "allreduce 'bad'" in errors["Max"]
        assert "Adasum" in errors["Adasum"] and "complex128" in errors["Adasum"]
        assert "'mixed'" in errors["mixed"] and "complex128" in errors["mixed"] and \
            "float64" in errors["mixed"]


NAME_CACHE = r'''
import torch
import fusionring.torch as hvd
from fusionring import state as _rt
hvd.init()
r, size = hvd.rank(), hvd.size()
negotiator = _rt.get()._negotiator
ok = True
exchanges = []
for step in range(60):
    # A name used once per step (as f"loss.{step}" would be) and two used every step.
    for name in (f"once.{step}", "every.a", "every.b"):
        got = hvd.allreduce(torch.full((3,), float(r + step)), name=name, op=hvd.Sum)
        ok &= bool(torch.all(got == sum(k + step for k in range(size))))
    exchanges.append(hvd.communication_stats()["full_exchanges"])
report({"ok": ok, "cached": len(negotiator._names_by_id),
        "names": sorted(negotiator._cache),
        # After the first steps, only the new name of each step needs a full exchange.
        "late_exchanges_per_step": (exchanges[-1] - exchanges[29]) / 30})
'''


def test_the_name_cache_keeps_the_recent_names_within_its_capacity(tmp_path):
    results = run_ranks(2, NAME_CACHE, tmp_path, timeout=90,
                        env={"FUSIONRING_CACHE_CAPACITY": "8"})
    for result in results:
        assert result["ok"]
        assert result["cached"] == 8                       # bounded, however many names came
        assert {"allreduce.every.a", "allreduce.every.b"} <= set(result["names"])
        assert result["late_exchanges_per_step"] == 1.0   # recurring names stay cached
    assert results[0]["names"] == results[1]["names"]     # every rank keeps the same cache


MIN_MAX_SPECIALS = r'''
import math, struct, torch
from mpi4py import MPI
import fusionring.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
comm = MPI.COMM_WORLD
nan, inf = float("nan"), float("inf")
# Per rank: NaN, signed zeros and equal values in different positions.
PATTERNS = [[nan, 3.0, 0.0, -0.0, 2.0, -inf, 1.0, -0.0],
            [1.0, nan, -0.0, 0.0, 2.0, inf, -0.0, -0.0],
            [0.0, 5.0, 0.0, nan, -2.0, 0.0, 0.0, -0.0]]

def rank_data(r, n, dtype):
    base = PATTERNS[r % len(PATTERNS)]
    return torch.tensor([base[(i + r) % len(base)] if i % 3 else base[i % len(base)]
                         for i in range(n)], dtype=torch.float64).to(dtype)

def expected(values, op):
    # NaN wins; -0 is below +0; else the ordinary min / max.
    if any(math.isnan(v) for v in values):
        return nan
    if op == "Min":
        m = min(values)
        return -0.0 if m == 0 and any(v == 0 and math.copysign(1, v) < 0 for v in values) else m
    m = max(values)
    return 0.0 if m == 0 and any(v == 0 and math.copysign(1, v) > 0 for v in values) else m

failures = []
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for n in (8, 17, 100003):
        xs = [rank_data(r, n, dtype).double().tolist() for r in range(size)]
        for op_name, op in (("Min", hvd.Min), ("Max", hvd.Max)):
            got = hvd.allreduce(rank_data(rank, n, dtype), op=op, name=f"{op_name}.{dtype}.{n}")
            raw = got.view(torch.int16 if got.element_size() == 2 else
                           torch.int32 if got.element_size() == 4 else torch.int64)
            if len(set(comm.allgather(raw.numpy().tobytes()))) != 1:
                failures.append(f"{op_name} {dtype} {n}: ranks differ")
            vals = got.double().tolist()
            for i in range(n):
                want = expected([x[i] for x in xs], op_name)
                v = vals[i]
                ok = (math.isnan(v) if math.isnan(want)
                      else v == want and math.copysign(1, v) == math.copysign(1, want))
                if not ok:
                    failures.append(f"{op_name} {dtype} {n}[{i}]: {v} != {want}")
                    break
    # reducescatter by the same rule: this rank's block of 6 rows (and a large one)
    for rows in (6, 40000):
        n = rows * size
        xs = [rank_data(r, n, dtype).double().tolist() for r in range(size)]
        for op_name, op in (("Min", hvd.Min), ("Max", hvd.Max)):
            got = hvd.reducescatter(rank_data(rank, n, dtype), op=op,
                                    name=f"rs.{op_name}.{dtype}.{n}").double().tolist()
            for j, v in enumerate(got):
                want = expected([x[rank * rows + j] for x in xs], op_name)
                ok = (math.isnan(v) if math.isnan(want)
                      else v == want and math.copysign(1, v) == math.copysign(1, want))
                if not ok:
                    failures.append(f"reducescatter {op_name} {dtype} {n}[{j}]: {v} != {want}")
                    break
report(failures)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_min_and_max_with_nan_and_signed_zeros_agree_on_every_rank(np_, tmp_path):
    """allreduce and reducescatter (whose MPI MIN / MAX compared with `<`)."""
    results = run_ranks(np_, MIN_MAX_SPECIALS, tmp_path, timeout=180)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"
