"""N:M compressed allreduce across ranks (mpiexec), against numpy simulations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_ranks
from test_nm import ref_keep, round_values

pytestmark = pytest.mark.timeout(120)


def rank_data(rank: int, step: int, count: int) -> np.ndarray:
    """Dyadic values (k/64, |k| < 2^10): float32 sums of a few of them are exact, so the ring
    and the numpy simulation agree bit for bit whatever the order of additions."""
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.integers(-1000, 1000, size=count) / 64.0).astype(np.float32)


# ---------------------------------------------------------------------- numpy simulations
def decode(x: np.ndarray, keep: np.ndarray, values) -> np.ndarray:
    return np.where(keep, round_values(x, values), 0.0).astype(np.float32)


def simulate_per_rank(inputs, residuals, n, m, values, prescale=1.0, postscale=1.0):
    """The compressed ring of csrc/nm_allreduce.cc: chunks of whole groups, each hop adds and
    re-selects, the owner selects once more, everyone decodes the owner's bytes."""
    P, count = len(inputs), inputs[0].size
    x = [(inp * np.float32(prescale) + res).astype(np.float32)
         for inp, res in zip(inputs, residuals)]
    new_res = [np.zeros(count, np.float32) for _ in range(P)]
    groups = -(-count // m)
    base, extra = divmod(groups, P)
    bounds = []
    for c in range(P):
        g0 = c * base + min(c, extra)
        g1 = g0 + base + (1 if c < extra else 0)
        bounds.append((min(g0 * m, count), min(g1 * m, count)))

    def compress(v):
        keep = ref_keep(v, n, m)
        return decode(v, keep, values)

    # message[r] = decoded payload rank r sends right at the current step
    message = {}
    for r in range(P):
        a, b = bounds[r]
        message[r] = compress(x[r][a:b])
        new_res[r][a:b] = x[r][a:b] - message[r]
    acc = {}
    for s in range(P - 1):
        incoming = {r: message[(r - 1) % P] for r in range(P)}
        message = {}
        for r in range(P):
            c = (r - s - 1) % P
            a, b = bounds[c]
            total = (x[r][a:b] + incoming[r]).astype(np.float32)
            if s + 1 < P - 1:
                message[r] = compress(total)
                new_res[r][a:b] = total - message[r]
            else:
                acc[r] = total
    out = np.zeros(count, np.float32)
    for r in range(P):
        c = (r + 1) % P
        a, b = bounds[c]
        total = acc[r] if P > 1 else x[r][a:b]
        sent = compress(total)
        new_res[r][a:b] = total - sent
        out[a:b] = sent
    return (out * np.float32(postscale)).astype(np.float32), new_res


def simulate_shared(inputs, residuals, state, n, m, values, postscale=1.0):
    """The shared-mask path: the mask comes from |estimate| * (1 + wait), identical on all
    ranks; the kept values are summed; the estimate follows the reduced result."""
    count = inputs[0].size
    x = [(inp + res).astype(np.float32) for inp, res in zip(inputs, residuals)]
    if state.get("estimate") is None or n == m:
        keep = np.ones(count, bool)
    else:
        score = (np.abs(state["estimate"]) * (state["wait"] + np.float32(1.0))).astype(np.float32)
        keep = ref_keep(score, n, m)
    sent = [decode(xi, keep, values) for xi in x]
    new_res = [(xi - si).astype(np.float32) for xi, si in zip(x, sent)]
    out = (np.sum(sent, axis=0, dtype=np.float32) * np.float32(postscale)).astype(np.float32)
    if state.get("estimate") is None or keep.all():
        state["estimate"], state["wait"] = out.copy(), np.zeros(count, np.float32)
    else:
        wait = state["wait"]
        state["estimate"] = np.where(keep, out / (wait + np.float32(1.0)),
                                     state["estimate"]).astype(np.float32)
        state["wait"] = np.where(keep, 0.0, wait + 1.0).astype(np.float32)
    return out, new_res, keep


# ---------------------------------------------------------------------- tests
PER_RANK_SCRIPT = '''
import numpy as np, torch
from mpi4py import MPI
from fusionring import _C
comm = MPI.COMM_WORLD.Dup()
core = _C.Communicator(MPI._handleof(comm))
r, P = comm.Get_rank(), comm.Get_size()
def rank_data(rank, step, count):
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.integers(-1000, 1000, size=count) / 64.0).astype(np.float32)
results = []
for case, (count, n, m, vcode, seg) in enumerate(CASES):
    residual = torch.zeros(count)
    for step in range(3):
        x = torch.from_numpy(rank_data(r, 10 * case + step, count))
        stats = core.nm_allreduce(x.data_ptr(), count, n, m, vcode, residual.data_ptr(), 1.0,
                                  0.5, seg)
        results.append({"out": x.tolist(), "residual": residual.tolist(), **stats})
report(results)
'''

PER_RANK_CASES = [(1003, 2, 4, 0, 1 << 20), (4096, 1, 4, 0, 512), (777, 3, 8, 2, 256),
                  (97, 5, 16, 3, 1 << 20), (5, 1, 2, 0, 1 << 20)]


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_per_rank_mask_allreduce_equals_the_simulated_compressed_ring(tmp_path, np_):
    code = f"CASES = {PER_RANK_CASES!r}\n" + PER_RANK_SCRIPT
    results = run_ranks(np_, code, tmp_path, timeout=60)
    codes = {0: torch.float32, 2: torch.float16, 3: torch.bfloat16}
    k = 0
    for case, (count, n, m, vcode, seg) in enumerate(PER_RANK_CASES):
        residuals = [np.zeros(count, np.float32) for _ in range(np_)]
        for step in range(3):
            inputs = [rank_data(r, 10 * case + step, count) for r in range(np_)]
            expected, residuals_next = simulate_per_rank(inputs, residuals, n, m, codes[vcode],
                                                         postscale=0.5)
            got = [np.asarray(results[r][k]["out"], np.float32) for r in range(np_)]
            for r in range(np_):
                assert np.array_equal(got[r], expected), (case, step, r)
                assert np.array_equal(np.asarray(results[r][k]["residual"], np.float32),
                                      residuals_next[r]), (case, step, r)
            # error feedback: what went in == what came out + what is held, on every element
            held = np.sum(residuals_next, axis=0, dtype=np.float64)
            fed = np.sum(inputs, axis=0, dtype=np.float64) + np.sum(residuals, axis=0,
                                                                     dtype=np.float64)
            np.testing.assert_allclose(got[0].astype(np.float64) * 2 + held, fed, atol=1e-6)
            nonzero = np.pad(got[0] != 0, (0, -count % m)).reshape(-1, m).sum(axis=1)
            assert nonzero.max() <= n
            # about 2 (P-1)/P of the compressed size per rank
            compressed = (-(-count // 64) * 8 + (count // m * n + min(n, count % m))
                          * (4 if vcode == 0 else 2))
            seg_elems = max(1, seg // (4 * m)) * m
            messages = 2 * (np_ - 1) * (-(-count // np_ // seg_elems) + 1)
            sent = results[0][k]["bytes_sent"]
            assert sent <= 2 * (np_ - 1) / np_ * compressed + messages * (16 + 4 * m)
            residuals = residuals_next
            k += 1


SHARED_SCRIPT = '''
import numpy as np, torch
import fusionring.torch as hvd
import fusionring.compression.nm as nm_module
if CHUNK:  # small pipeline chunks: many encode/reduce/decode stages, one spanning both tensors
    nm_module.PIPELINE_CHUNK_ELEMENTS = CHUNK
hvd.init()
r = hvd.rank()
def rank_data(rank, step, count):
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.integers(-1000, 1000, size=count) / 64.0).astype(np.float32)
c = hvd.Compression.nm(N, M, values=VALUES)
outs, residuals = [], []
for step in range(STEPS):
    a = torch.from_numpy(rank_data(r, step, 1003))
    b = torch.from_numpy(rank_data(r, 100 + step, 64))
    # two named tensors fused into one batch; Sum keeps the arithmetic exact
    ha = hvd.allreduce_async_(a, name="a", op=hvd.Sum, compression=c)
    hb = hvd.allreduce_async_(b, name="b", op=hvd.Sum, compression=c)
    outs.append([hvd.synchronize(ha).tolist(), hvd.synchronize(hb).tolist()])
    residuals.append([c.memory.residuals["allreduce.a"].tolist(),
                      c.memory.residuals["allreduce.b"].tolist()])
avg = hvd.allreduce(torch.full((16,), float(r + 1)), name="avg", op=hvd.Average,
                    compression=c)
try:
    hvd.allreduce(torch.ones(8), name="min", op=hvd.Min, compression=c)
    error = ""
except ValueError as exc:
    error = str(exc)
report({"outs": outs, "residuals": residuals, "avg": avg.tolist(), "error": error,
        "stats": c.stats})
'''


@pytest.mark.parametrize("chunk", [0, 300])
def test_shared_mask_allreduce_equals_numpy_masked_sum(tmp_path, chunk):
    P, N, M, steps = 3, 1, 4, 6
    code = (f"import torch\nN, M, VALUES, STEPS, CHUNK = {N}, {M}, torch.float32, {steps}, "
            f"{chunk}\n" + SHARED_SCRIPT)
    results = run_ranks(P, code, tmp_path, timeout=60)
    for t, (offset, count) in enumerate([(0, 1003), (100, 64)]):
        state, residuals = {}, [np.zeros(count, np.float32) for _ in range(P)]
        for step in range(steps):
            inputs = [rank_data(r, offset + step, count) for r in range(P)]
            expected, residuals, keep = simulate_shared(inputs, residuals, state, N, M,
                                                        torch.float32)
            for r in range(P):
                assert np.array_equal(np.asarray(results[r]["outs"][step][t], np.float32),
                                      expected), (t, step, r)
                assert np.array_equal(np.asarray(results[r]["residuals"][step][t], np.float32),
                                      residuals[r])
            if step > 0:
                assert keep.sum() == count // M * N + min(N, count % M)
    first = results[0]
    assert first["avg"] == [2.0] * 16  # mean of 1, 2, 3 (first use: dense)
    assert "Sum or Average" in first["error"]
    # steps 1.. send 1/4 of the values, no mask
    dense = 4 * (1003 + 64) * steps + 16 * 4
    assert first["stats"]["payload_bytes"] < 0.4 * dense


TRAIN_SCRIPT = '''
import copy, numpy as np, torch, torch.nn as nn
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()

def batch(step):
    g = torch.Generator().manual_seed(1000 * r + step)
    x = torch.randn(32, 20, generator=g)
    return x, (x[:, :5].sum(dim=1) > 0).long()

def make(kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
    # One explicit fusion group: the same fused layout every step, so the run is reproducible
    # (threshold fusion batches whatever is ready, which changes rounding and N:M groups).
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.nm(**kwargs), groups=1)
    return model, opt

def train(model, opt, steps, start):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

out = {}
for label, kwargs in KWARGS.items():
    model, opt = make(kwargs)
    losses = train(model, opt, 30, 0)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    train(model, opt, 8, 30)
    continued = [p.detach().clone() for p in model.parameters()]
    fresh, fresh_opt = make(kwargs)
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    train(fresh, fresh_opt, 8, 30)
    resumed = [p.detach().clone() for p in fresh.parameters()]
    out[label] = {
        "first": float(np.mean(losses[:5])), "last": float(np.mean(losses[-5:])),
        "params": torch.cat([p.reshape(-1) for p in continued]).tolist(),
        "resume_exact": all(torch.equal(a, b) for a, b in zip(continued, resumed)),
        "level": list(opt._compression.level("allreduce.0.weight")),
        "level_by_name": list(opt._compression.level("0.weight")),
    }
report(out)
'''


def test_distributed_optimizer_trains_agrees_across_ranks_and_resumes_exactly(tmp_path):
    kwargs = {
        "shared": dict(n=2, m=4),
        "per_rank_f16": dict(n=2, m=4, values=torch.float16, shared_mask=False),
        "scheduled": dict(n=1, m=4, schedule=[(0, (4, 4)), (5, (2, 4)), (20, (1, 4))]),
        "adaptive": dict(n=1, m=4, shared_mask=False, schedule="adaptive"),
    }
    code = f"import torch\nKWARGS = {kwargs!r}\n" + TRAIN_SCRIPT
    results = run_ranks(2, code, tmp_path, timeout=90)
    for label in kwargs:
        a, b = results[0][label], results[1][label]
        assert a["params"] == b["params"], label           # identical parameters on all ranks
        assert a["resume_exact"] and b["resume_exact"], label
        assert a["last"] < 0.6 * a["first"], (label, a["first"], a["last"])
        assert a["level"] == b["level"]
        assert a["level_by_name"] == a["level"], label   # the parameter's own name works too
    assert results[0]["scheduled"]["level"] == [1, 4]


OVERFLOW_STEP = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
codec = {{"nm": lambda: hvd.Compression.nm(2, 4, values=torch.float16),
          "nm_per_rank": lambda: hvd.Compression.nm(2, 4, values=torch.float16, shared_mask=False),
          "cluster": lambda: hvd.Compression.cluster(k=4, values=torch.float16)}}["{kind}"]()
counts = []
for step in range(8):
    x = torch.linspace(-1, 1, 64) * (r + 1)
    if step == 2 and r == 0:
        x = x * 1e6     # finite in float32, beyond float16 (a loss scaler's overflowing probe)
    y = hvd.allreduce(x, name="g", compression=codec, op=hvd.Average)
    counts.append(int((~torch.isfinite(y)).sum()))
report(counts)
'''


@pytest.mark.parametrize("kind", ["nm", "nm_per_rank", "cluster"])
def test_a_step_beyond_float16s_range_is_not_finite_that_step_only(tmp_path, kind):
    """Values held back (N:M) or kept because their bucket's mean overflowed (cluster) are not
    carried into later steps when they are beyond float16's range: sent later, they would
    arrive as inf again."""
    results = run_ranks(2, OVERFLOW_STEP.format(kind=kind), tmp_path, timeout=90)
    assert results[0] == results[1]
    counts = results[0]
    assert counts[2] > 0 and counts[:2] == [0, 0] and counts[3:] == [0] * 5, counts
