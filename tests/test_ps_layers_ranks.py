"""Layer selection under the parameter server: each worker pushes its own k layers (norm, hyper), the rest wait on the
worker; the accumulation identity holds and the parameters match a single-process reference."""
import pytest
import torch

from conftest import run_ranks

SCRIPT = r'''
import atexit, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)

KIND = "@KIND@"

def selection(m):
    if KIND == "hyper":  # each worker's hypernetwork learns, and earns credit, from its own gradients
        return hvd.LayerSelection.hyper(m, fraction=0.5, hidden=8, lr=1e-2)
    return hvd.LayerSelection.norm(fraction=0.5)

model, ref = build(), build()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                              named_parameters=model.named_parameters(), sync="bsp",
                              layer_selection=selection(model))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
# the reference: one selector per worker, each choosing from its own accumulated gradients
ref_sel = [selection(ref) for _ in range(W)]
for s in ref_sel:
    s.attach(ref.named_parameters())
raw_sum = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
for step in range(6):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward()
    for n, p in model.named_parameters():
        raw_sum[n] += p.grad
    opt.step()
    sent = []
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        sel = ref_sel[j]
        summed = {n: sel.acc.add(n, p.grad.clone()) for n, p in ref.named_parameters()}
        chosen = sel.choose(sel.scores(summed)); sel.step_count += 1
        sel.acc.settle(chosen, sel.layers, summed)
        sent.append({n: summed[n] for i in chosen for n in sel.layers[i]})
    for n, p in ref.named_parameters():
        terms = [s[n] / W for s in sent if n in s]
        p.grad = sum(terms) if terms else None
    ref_opt.step()
residual = {n: t.tolist() for n, t in opt.layer_selection.acc.residual.items()}
ps.shutdown()
report({"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        "raw_sum": {n: t.tolist() for n, t in raw_sum.items()}, "residual": residual})
'''


@pytest.mark.parametrize("kind", ["norm", "hyper"])
def test_each_worker_pushes_its_own_layers_and_keeps_the_rest(tmp_path, kind):
    record_path = str(tmp_path / "arrivals")
    results = run_ranks(3, SCRIPT.replace("@KIND@", kind), tmp_path, timeout=150, env={"FUSIONRING_PS_RECORD": record_path})
    record = torch.load(record_path + ".server0", weights_only=False)
    pushes = [e for e in record["events"] if e[0] == "push"]
    names = record["names"]
    for k, r in ((0, results[1]), (1, results[2])):
        assert r["diff"] < 1e-6, r
        mine = [e[4] for e in pushes if e[1] == k]
        assert len(mine) == 6
        assert all(0 < len(g) < len(names) for g in mine)  # a part of the layers each step
        for n in names:
            # accumulation identity: what reached the server plus what waits equals the sum of the gradients
            sent = sum((g[n] for g in mine if n in g), torch.zeros_like(record["initial"][n]))
            kept = torch.tensor(r["residual"][n]) if n in r["residual"] else torch.zeros_like(sent)
            torch.testing.assert_close(sent + kept, torch.tensor(r["raw_sum"][n]).reshape(sent.shape),
                                       rtol=0, atol=1e-5)
    # no agreement: the workers' choices differ on some step
    assert [sorted(g) for g in (e[4] for e in pushes if e[1] == 0)] != \
        [sorted(g) for g in (e[4] for e in pushes if e[1] == 1)]
