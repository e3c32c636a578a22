"""Cluster-quantized allreduce across ranks (mpiexec): the compressed ring against a
single-process replay of the same ring on the decoded payloads, error feedback's identity, and
DistributedOptimizer with Compression.cluster."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_ranks
from fusionring import _C

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------- single-process replay
def replay_ring(inputs, residuals, *, k, sample, buckets, seed, step, prescale=1.0,
                postscale=1.0, segment_bytes=1 << 20):
    """csrc/compressed_ring.cc in one process with the cluster kernels: chunks of the buffer,
    segments of segment_bytes / 4 values each one payload, each hop decodes, adds and
    re-encodes (keeping the loss as its residual), owners encode once more, and everyone
    decodes the owners' payloads. Returns (result, new residuals)."""
    P, count = len(inputs), inputs[0].size
    x = [np.asarray(inp, np.float32) * np.float32(prescale) if prescale != 1.0
         else np.asarray(inp, np.float32).copy() for inp in inputs]
    x = [(xi + np.asarray(res, np.float32)).astype(np.float32) for xi, res in zip(x, residuals)]
    new_res = [np.zeros(count, np.float32) for _ in range(P)]
    base, extra = divmod(count, P)
    bounds = [(c * base + min(c, extra), (c + 1) * base + min(c + 1, extra)) for c in range(P)]
    seg = max(1, segment_bytes // 4)

    def encode(r, total, a):
        """Payloads of total (values a..), decoded; the loss goes to rank r's residual."""
        decoded = np.empty_like(total)
        for lo in range(0, total.size, seg):
            part = torch.from_numpy(np.ascontiguousarray(total[lo:lo + seg]))
            n = part.numel()
            payload = torch.empty(_C.cluster_payload_bytes(n, k, sample, buckets, 0),
                                  dtype=torch.uint8)
            res = torch.empty(n)
            _C.cluster_encode(part.data_ptr(), n, k, sample, buckets, 0,
                              _C.cluster_stream(seed, step, a + lo), payload.data_ptr(),
                              res.data_ptr())
            out = torch.empty(n)
            _C.cluster_decode(payload.data_ptr(), n, k, sample, buckets, 0, out.data_ptr(), False)
            decoded[lo:lo + n] = out.numpy()
            new_res[r][a + lo:a + lo + n] = res.numpy()
        return decoded

    if P == 1:
        out = encode(0, x[0], 0)
        return (out * np.float32(postscale)).astype(np.float32), new_res
    message = {r: encode(r, x[r][bounds[r][0]:bounds[r][1]], bounds[r][0]) for r in range(P)}
    acc = {}
    for s in range(P - 1):
        incoming = {r: message[(r - 1) % P] for r in range(P)}
        message = {}
        for r in range(P):
            a, b = bounds[(r - s - 1) % P]
            total = (x[r][a:b] + incoming[r]).astype(np.float32)
            if s + 1 < P - 1:
                message[r] = encode(r, total, a)
            else:
                acc[r] = total
    out = np.zeros(count, np.float32)
    for r in range(P):
        a, b = bounds[(r + 1) % P]
        out[a:b] = encode(r, acc[r], a)
    if postscale != 1.0:
        out = (out * np.float32(postscale)).astype(np.float32)
    return out, new_res


# ---------------------------------------------------------------------- the core's ring
CORE_SCRIPT = '''
import numpy as np, torch
from mpi4py import MPI
from fusionring import _C
comm = MPI.COMM_WORLD.Dup()
core = _C.Communicator(MPI._handleof(comm))
r, P = comm.Get_rank(), comm.Get_size()
results = []
for case, (count, k, buckets, seg, post) in enumerate(CASES):
    rng = np.random.default_rng(100 * r + case)
    residual = torch.from_numpy((rng.standard_normal(count) * 0.01).astype(np.float32))
    for step in range(2):
        x = torch.from_numpy((rng.standard_t(3, count) * 0.1).astype(np.float32))
        before = {"input": x.tolist(), "residual": residual.tolist()}
        stats = core.cluster_allreduce(x.data_ptr(), count, k, 256, buckets, 0, 42, step,
                                       residual.data_ptr(), 1.0, post, seg)
        results.append({**before, "out": x.tolist(), "new_residual": residual.tolist(), **stats})
report(results)
'''
CORE_CASES = [(5000, 16, 64, 4096, 1.0), (777, 4, 9, 400, 0.5), (3, 16, 64, 1 << 20, 1.0)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_equals_a_single_process_replay_and_keeps_the_identity(tmp_path, ranks):
    got = run_ranks(ranks, f"CASES = {CORE_CASES!r}\n" + CORE_SCRIPT, tmp_path)
    i = 0
    for count, k, buckets, seg, post in CORE_CASES:
        for step in range(2):
            rows = [got[r][i] for r in range(ranks)]
            i += 1
            outs = [np.array(row["out"], np.float32) for row in rows]
            for out in outs[1:]:
                np.testing.assert_array_equal(out, outs[0])  # every rank decodes the same bytes
            inputs = [np.array(row["input"], np.float32) for row in rows]
            old = [np.array(row["residual"], np.float32) for row in rows]
            want, want_res = replay_ring(inputs, old, k=k, sample=256, buckets=buckets, seed=42,
                                         step=step, postscale=post, segment_bytes=seg)
            np.testing.assert_array_equal(outs[0], want)
            for row, res in zip(rows, want_res):
                np.testing.assert_array_equal(np.array(row["new_residual"], np.float32), res)
            # error feedback: everything in == what was delivered + what is still held
            total_in = np.sum([a.astype(np.float64) + b for a, b in zip(inputs, old)], axis=0)
            held = np.sum([np.array(row["new_residual"], np.float64) for row in rows], axis=0)
            np.testing.assert_allclose(outs[0] / post + held, total_in, atol=1e-5)
            assert all(row["bytes_sent"] < 4 * count for row in rows) or count < 100


# ---------------------------------------------------------------------- DistributedOptimizer
OPTIMIZER_SCRIPT = '''
import copy
import numpy as np, torch, torch.nn as nn
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
torch.manual_seed(0)

def batch(step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)

def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 3))
    comp = hvd.Compression.cluster(k=16, sample=512, buckets=None, seed=7)  # 16 buckets
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, groups=1)
    return model, opt, comp

model, opt, comp = make()
initial = [p.detach().clone().reshape(-1).tolist() for p in model.parameters()]
jobs = []
inner = comp.communicate
def recording(job):
    # what a single process needs to replay this reduction
    old = [comp.memory.residuals.get(key) for key in job.keys]
    rec = {"position": comp.position, "prescale": job.prescale, "postscale": job.postscale,
           "segment": max(job.ring_segment_bytes, 4 << 20), "keys": list(job.keys),
           "input": torch.cat([o.reshape(-1) for o in job.outputs]).tolist(),
           "residual": torch.cat([(torch.zeros(o.numel()) if s is None else s.reshape(-1))
                                  for o, s in zip(job.outputs, old)]).tolist()}
    sent = inner(job)
    rec["out"] = torch.cat([o.reshape(-1) for o in job.outputs]).tolist()
    rec["new_residual"] = torch.cat([comp.memory.residuals[key].reshape(-1)
                                     for key in job.keys]).tolist()
    jobs.append(rec)
    return sent
comp.communicate = recording

def train(model, opt, steps, start):
    for step in range(start, start + steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

train(model, opt, 4, 0)
comp.communicate = inner
saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
after = [p.detach().clone() for p in model.parameters()]
train(model, opt, 3, 4)
continued = [p.detach().clone() for p in model.parameters()]
fresh, fresh_opt, _ = make()
fresh.load_state_dict(saved[0])
fresh_opt.load_state_dict(saved[1])
train(fresh, fresh_opt, 3, 4)
resumed = [p.detach().clone() for p in fresh.parameters()]
report({"initial": initial, "params": [p.reshape(-1).tolist() for p in after],
        "names": [n for n, _ in model.named_parameters()], "jobs": jobs,
        "resume_exact": all(torch.equal(a, b) for a, b in zip(continued, resumed)),
        "finite": all(bool(torch.isfinite(p).all()) for p in continued)})
'''


@pytest.mark.parametrize("ranks", [2, 3])
def test_distributed_optimizer_agrees_with_a_single_process_replay(tmp_path, ranks):
    got = run_ranks(ranks, OPTIMIZER_SCRIPT, tmp_path, timeout=150)
    for g in got[1:]:
        assert g["params"] == got[0]["params"]  # identical parameters on every rank
    assert all(g["resume_exact"] and g["finite"] for g in got)
    jobs = [g["jobs"] for g in got]
    assert len(jobs[0]) >= 4 and all(len(j) == len(jobs[0]) for j in jobs)
    # Replay every reduction in one process from the ranks' gradients and residuals.
    reduced = {}
    for step, rows in enumerate(zip(*jobs)):
        first = rows[0]
        assert all(row["keys"] == first["keys"] for row in rows)
        want, want_res = replay_ring(
            [np.array(row["input"], np.float32) for row in rows],
            [np.array(row["residual"], np.float32) for row in rows],
            k=16, sample=512, buckets=16, seed=7, step=first["position"],
            prescale=first["prescale"], postscale=first["postscale"],
            segment_bytes=first["segment"])
        for row, res in zip(rows, want_res):
            np.testing.assert_array_equal(np.array(row["out"], np.float32), want)
            np.testing.assert_array_equal(np.array(row["new_residual"], np.float32), res)
        reduced.setdefault(tuple(first["keys"]), []).append(want)
    # Plain SGD in one process on the replayed (decoded) gradients gives the ranks' parameters.
    names = got[0]["names"]
    params = {n: np.array(p, np.float32) for n, p in zip(names, got[0]["initial"])}
    per_step = list(zip(*[[(keys, g) for g in grads] for keys, grads in reduced.items()]))
    assert len(per_step) == 4
    for step_jobs in per_step:
        for keys, grad in step_jobs:
            at = 0
            for key in keys:
                name = next(n for n in names if key.endswith(n))
                size = params[name].size
                params[name] = (params[name] - np.float32(0.2) * grad[at:at + size]).astype(
                    np.float32)
                at += size
    for name, p in zip(names, got[0]["params"]):
        np.testing.assert_allclose(params[name], np.array(p, np.float32), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- hvd.allreduce
ALLREDUCE_SCRIPT = '''
import numpy as np, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
comp = hvd.Compression.cluster(k=8, sample=300, seed=11)
rng = np.random.default_rng(r)
rows = []
for step in range(2):
    x = torch.from_numpy(rng.standard_normal(10_000).astype(np.float32))
    old = next(iter(comp.memory.residuals.values()), None)  # the one tensor's residual
    before = {"input": x.tolist(), "position": comp.position,
              "residual": (torch.zeros(10_000) if old is None else old).tolist()}
    y = hvd.allreduce(x, name="x", op=hvd.Sum, compression=comp)
    (new,) = comp.memory.residuals.values()
    rows.append({**before, "out": y.tolist(), "new_residual": new.tolist()})
errors = []
try:
    hvd.allreduce(torch.ones(10), name="bad", op=hvd.Max, compression=comp)
except Exception as exc:
    errors.append(f"{type(exc).__name__}: {exc}")
report({"rows": rows, "errors": errors})
'''


def test_allreduce_with_the_compressor_sums_on_the_compressed_ring(tmp_path):
    got = run_ranks(2, ALLREDUCE_SCRIPT, tmp_path, timeout=120)
    for step in range(2):
        rows = [g["rows"][step] for g in got]
        want, want_res = replay_ring([np.array(row["input"], np.float32) for row in rows],
                                     [np.array(row["residual"], np.float32) for row in rows],
                                     k=8, sample=300, buckets=8, seed=11,
                                     step=rows[0]["position"])
        for row, res in zip(rows, want_res):
            np.testing.assert_array_equal(np.array(row["out"], np.float32), want)
            np.testing.assert_array_equal(np.array(row["new_residual"], np.float32), res)
    for g in got:  # Max cannot be reduced by a quantizer: a clear error on every rank
        assert len(g["errors"]) == 1 and "Compression.cluster" in g["errors"][0]


GROUPED_SCRIPT = '''
import torch
import fusionring.torch as hvd

hvd.init()
c = hvd.Compression.cluster(k=8, sample=300, seed=3)
rows = []
for step in range(6):
    g = torch.Generator().manual_seed(100 * step + hvd.rank())
    xs = [torch.randn(n, generator=g) for n in (500, 3, 1200)]
    before = c.stats["reductions"]
    residual = [c.memory.residuals.get(f"allreduce.grp.{i}", torch.zeros(x.numel())).clone()
                for i, x in enumerate(xs)]
    position = c.position
    out = hvd.grouped_allreduce(xs, name="grp", op=hvd.Sum, compression=c)
    rows.append({"input": torch.cat(xs).tolist(), "residual": torch.cat(residual).tolist(),
                 "position": position, "out": torch.cat(out).tolist(),
                 "reductions": c.stats["reductions"] - before})
report(rows)
hvd.shutdown()
'''


def test_a_grouped_allreduce_is_one_compressed_reduction(tmp_path):
    """The group's tensors are negotiated and fused together: one ring over their
    concatenation per call, whatever the timing."""
    got = run_ranks(2, GROUPED_SCRIPT, tmp_path, timeout=120)
    for step in range(6):
        rows = [g[step] for g in got]
        assert [row["reductions"] for row in rows] == [1, 1], step
        want, _ = replay_ring([np.array(row["input"], np.float32) for row in rows],
                              [np.array(row["residual"], np.float32) for row in rows],
                              k=8, sample=300, buckets=8, seed=3, step=rows[0]["position"],
                              segment_bytes=4 << 20)
        for row in rows:
            np.testing.assert_array_equal(np.array(row["out"], np.float32), want)
