"""Buffers (BatchNorm's running statistics) under the parameter server, with named_buffers=: every worker starts
with worker 0's and takes worker 0's latest with each reply, as DDP's broadcast_buffers does; checkpoints hold them,
so a resumed run continues bit for bit. Without named_buffers= each worker keeps its own."""
import os

import pytest

from conftest import run_ranks

SCRIPT = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
MODE, PATH, WITH_BUFFERS, N, M = @MODE@, @PATH@, @WITH@, 3, 3
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()

def build(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(8, 6, generator=g) * (1 + 2 * worker), torch.randn(8, 3, generator=g)  # scales differ

model = build(k + (10 if MODE == "resume" else 0))   # worker 0's (or the saved) values must win
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                              named_parameters=model.named_parameters(), sync="bsp",
                              named_buffers=model.named_buffers() if WITH_BUFFERS else None)
out = {"start": {n: b.tolist() for n, b in model.named_buffers()}}
ref = build(0)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
first = 0
if MODE == "resume":
    opt.load_state_dict(torch.load(PATH))
    first = N
    out["loaded"] = {n: b.tolist() for n, b in model.named_buffers()}
last = N if MODE == "save" else N + M
for step in range(first, last):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    if MODE == "full":
        # the reference: one process, the gradients averaged; its running statistics are worker 0's alone
        before = {n: b.clone() for n, b in ref.named_buffers()}
        grads = []
        for j in range(W):
            ref.zero_grad(); xj, yj = batch(j, step)
            torch.nn.functional.mse_loss(ref(xj), yj).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for n, b in ref.named_buffers():
                b.copy_(before[n])
            ref(batch(0, step)[0])   # training mode: worker 0's batch moves the statistics, once
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / W
        ref_opt.step()
if MODE == "save":
    ps.save(PATH)
    out["saved"] = {n: b.tolist() for n, b in model.named_buffers()}
ps.shutdown()
out["buffers"] = {n: b.tolist() for n, b in model.named_buffers()}
out["ref_buffers"] = {n: b.tolist() for n, b in ref.named_buffers()}
out["diff"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
out["bits"] = [t.detach().numpy().tobytes().hex() for t in list(model.parameters()) + list(model.buffers())]
report(out)
'''


def _run(tmp_path, mode, path, with_buffers=True):
    code = SCRIPT.replace("@MODE@", repr(mode)).replace("@PATH@", repr(path)).replace("@WITH@", repr(with_buffers))
    return run_ranks(3, code, tmp_path / f"{mode}{int(with_buffers)}", timeout=120)


def test_every_worker_takes_worker_0s_buffers_and_checkpoints_hold_them(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    full = _run(tmp_path, "full", path)
    for r in full[1:]:
        assert r["start"] == full[1]["start"]            # worker 0's at the start
        assert r["buffers"] == full[1]["buffers"]        # the same on every worker after each reply
        assert r["diff"] < 1e-6, r
        for name, want in r["ref_buffers"].items():
            assert name in r["buffers"]
            assert max(abs(a - b) for a, b in zip(np_flat(r["buffers"][name]), np_flat(want))) < 1e-6, name
    assert full[1]["buffers"]["1.num_batches_tracked"] == 6

    saved = _run(tmp_path, "save", path)
    assert os.path.exists(path + ".server0")
    resumed = _run(tmp_path, "resume", path)
    for k in (1, 2):
        assert resumed[k]["loaded"] == saved[1]["saved"]   # worker 0's statistics, restored on every worker
        assert resumed[k]["bits"] == full[k]["bits"]       # parameters and buffers: as if never interrupted


def test_without_named_buffers_each_worker_keeps_its_own(tmp_path):
    results = _run(tmp_path, "full", str(tmp_path / "unused.pt"), with_buffers=False)
    assert results[1]["start"] != results[2]["start"] or results[1]["buffers"] != results[2]["buffers"]
    assert results[1]["buffers"]["1.running_var"] != results[2]["buffers"]["1.running_var"]


def np_flat(value):
    if isinstance(value, list):
        return [x for v in value for x in np_flat(v)]
    return [value]
