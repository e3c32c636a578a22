"""Layer selection across ranks (mpiexec): one agreed choice, a single-process reference, replicas."""
from __future__ import annotations

import pytest

from conftest import run_ranks

pytestmark = pytest.mark.timeout(180)

CODE = '''
import torch
import fusionring.torch as hvd
from fusionring.selection import Accumulator, top_k
hvd.init()
rank, size = hvd.rank(), hvd.size()
KIND, COMP = {kind!r}, {comp!r}
torch.set_default_dtype(torch.float64)

def model_():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(8)])

def data(r, step):
    g = torch.Generator().manual_seed(100 * r + step)
    return torch.randn(4, 3, generator=g)

def make_sel(m):
    if KIND == "hyper":
        return hvd.LayerSelection.hyper(m, fraction=0.25, hidden=8, lr=1e-2, max_wait=3)
    if KIND == "hyper-warmup":
        return hvd.LayerSelection.hyper(m, fraction=0.25, hidden=8, lr=1e-2, warmup_steps=2)
    if KIND == "norm":
        return hvd.LayerSelection.norm(0.25, max_wait=3)
    return hvd.LayerSelection.random(0.25, seed=5)

comp = {{"none": hvd.Compression.none, "fp16": hvd.Compression.fp16, "nm": hvd.Compression.nm(2, 4) if COMP == "nm" else None}}[COMP]
model = model_()
sel = make_sel(model)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               layer_selection=sel, compression=comp)
choices, residual_ok = [], True
for step in range(4):
    opt.zero_grad()
    model(data(rank, step)).pow(2).sum().backward()
    opt.step()
    choices.append(list(sel.acc.waited))

# Single-process reference: every rank's gradients computed here, the same policy per rank.
ref = model_()
sels = [make_sel(ref) for _ in range(size)]
for s_ in sels:
    s_.attach(ref.named_parameters())
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
named = dict(ref.named_parameters())
for step in range(4):
    summed, scores = [], torch.zeros(len(sels[0].layers), dtype=torch.float64)
    for r in range(size):
        ref.zero_grad()
        ref(data(r, step)).pow(2).sum().backward()
        summed.append({{n: sels[r].acc.add(n, p.grad) for n, p in named.items()}})
        scores += torch.tensor(sels[r].scores(summed[r]), dtype=torch.float64)
    chosen = [s_.choose(scores.tolist()) for s_ in sels]
    assert all(c == chosen[0] for c in chosen)
    for p in named.values():
        p.grad = None
    for i in chosen[0]:
        for n in sels[0].layers[i]:
            named[n].grad = sum(sm[n] for sm in summed) / size
    ref_opt.step()
    for r in range(size):
        sels[r].step_count += 1
        sels[r].acc.settle(chosen[0], sels[r].layers, summed[r])
close = all(torch.allclose(a, b, rtol=0, atol=1e-12 if COMP == "none" else 1e-2)
            for a, b in zip(model.parameters(), ref.parameters()))
report({{"waited": choices, "close": close,
         "params": [p.detach().flatten().tolist() for p in model.parameters()]}})
'''


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("kind", ["norm", "random", "hyper"])
def test_every_rank_agrees_and_replicas_stay_identical(tmp_path, np_, kind):
    res = run_ranks(np_, CODE.format(kind=kind, comp="none"), tmp_path, timeout=150)
    for r in res[1:]:
        assert r == res[0]
    assert any(0 in w and max(w) > 0 for w in res[0]["waited"])
    assert res[0]["close"]


def test_warmup_sends_every_layer_then_k_against_the_reference(tmp_path):
    res = run_ranks(2, CODE.format(kind="hyper-warmup", comp="none"), tmp_path, timeout=150)
    assert res[1] == res[0]
    waited = res[0]["waited"]
    assert waited[0] == waited[1] == [0] * 8            # the warm-up: every layer sent
    assert [w.count(0) for w in waited[2:]] == [2, 2]   # then k = 2 of 8
    assert res[0]["close"]


@pytest.mark.parametrize("comp", ["fp16", "nm"])
def test_selected_buffer_composes_with_compression(tmp_path, comp):
    res = run_ranks(2, CODE.format(kind="norm", comp=comp), tmp_path, timeout=150)
    assert res[1] == res[0]
    if comp == "fp16":  # N:M drops values by design: only agreement and replicas are pinned
        assert res[0]["close"]


IDENTITY = '''
import torch
from mpi4py import MPI
import fusionring.torch as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
KIND, COMP = {kind!r}, {comp!r}
torch.manual_seed(0)
# Eight layers, several of one shape: a residual that went to the wrong layer would show.
model = torch.nn.Sequential(torch.nn.Linear(6, 8), *[torch.nn.Linear(8, 8) for _ in range(6)],
                            torch.nn.Linear(8, 3))
comp = {{"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
         "nm": hvd.Compression.nm(2, 4) if COMP == "nm" else None,
         "cluster": hvd.Compression.cluster(k=4, sample=64) if COMP == "cluster" else None}}[COMP]
sel = (hvd.LayerSelection.hyper(model, fraction=0.25, hidden=8, max_wait=4) if KIND == "hyper"
       else hvd.LayerSelection.norm(0.25, max_wait=4))
# lr=0: the weights stay put, so every step's gradient comes from the data alone.
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               named_parameters=model.named_parameters(),
                               layer_selection=sel, compression=comp)
names = [n for n, _ in model.named_parameters()]
local = {{n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}}
sent = {{n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}}
g = torch.Generator().manual_seed(10 + rank)
for step in range(9):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(16, 6, generator=g)),
                                      torch.randint(0, 3, (16,), generator=g)).backward()
    for n, p in model.named_parameters():
        local[n] += p.grad.double()
    opt.step()
    for n, p in model.named_parameters():
        if p.grad is not None:
            sent[n] += p.grad.double() * size   # the average of the ranks' sums, times size
kept = {{n: sel.acc.residual.get(n, torch.zeros_like(local[n])).double() for n in names}}
if COMP in ("nm", "cluster"):  # what the compressor held back stays with its parameter too
    for key, r in comp.memory.residuals.items():
        n = key.split("layer_selection.", 1)[1]
        kept[n] += r.reshape(kept[n].shape).double()
comm = MPI.COMM_WORLD
worst = 0.0
for n in names:
    total = comm.allreduce(local[n].numpy(), op=MPI.SUM)
    held = comm.allreduce(kept[n].numpy(), op=MPI.SUM)
    scale = max(1.0, float(abs(total).max()))
    worst = max(worst, float(abs(sent[n].numpy() + held - total).max()) / scale)
report({{"worst": worst, "waited": sel.acc.waited,
         "keys": sorted(comp.memory.residuals) if COMP in ("nm", "cluster") else []}})
'''


@pytest.mark.parametrize("kind,comp", [("norm", "none"), ("hyper", "none"), ("norm", "fp16"),
                                       ("norm", "nm"), ("hyper", "nm"), ("norm", "cluster")])
def test_sent_plus_residual_equals_the_sum_of_every_ranks_gradients(tmp_path, kind, comp):
    res = run_ranks(3, IDENTITY.format(kind=kind, comp=comp), tmp_path, timeout=150)
    tol = {"none": 1e-6, "fp16": 2e-3, "nm": 1e-5, "cluster": 1e-5}[comp]
    for r in res:
        assert r["worst"] < tol, r["worst"]
    assert res[0]["waited"] == res[1]["waited"] == res[2]["waited"]
    if comp in ("nm", "cluster"):  # one residual per parameter, never one per step's buffer
        assert res[0]["keys"] and all("layer_selection." in k for k in res[0]["keys"])


STATS = '''
import torch
import fusionring.torch as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
widths = [5, 40, 30, 20, 12, 9, 7, 6, 4]   # eight layers of different sizes
model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
sel = hvd.LayerSelection.round_robin(0.25)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), layer_selection=sel)
params = dict(model.named_parameters())
rows = []
for step in range(4):
    opt.zero_grad()
    model(torch.randn(3, 5)).sum().backward()
    before = hvd.communication_stats()["bytes_sent"]
    opt.step()
    delta = hvd.communication_stats()["bytes_sent"] - before
    chosen = [i for i, w in enumerate(sel.acc.waited) if w == 0]
    chosen_bytes = sum(params[n].numel() * 4 for i in chosen for n in sel.layers[i])
    rows.append({"delta": delta, "chosen_bytes": chosen_bytes, "layers": len(sel.layers)})
dense = sum(p.numel() * 4 for p in model.parameters())
report({"rows": rows, "dense": dense})
'''


@pytest.mark.parametrize("np_", [2, 4])
def test_communication_stats_count_the_agreement_and_the_chosen_layers(tmp_path, np_):
    res = run_ranks(np_, STATS, tmp_path, timeout=150)
    ring = lambda nbytes: nbytes * 2 * (np_ - 1) / np_  # noqa: E731 - what a ring sends per rank
    for r in res:
        assert r == res[0] or r["rows"] == res[0]["rows"]
        for row in r["rows"]:
            want = ring(8 * row["layers"]) + ring(row["chosen_bytes"])
            # The runtime rounds down per fused batch: a byte or so per request.
            assert abs(row["delta"] - want) <= 16, (row, want)
            assert row["delta"] < ring(r["dense"])


OWNERSHIP = '''
import torch
import fusionring.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
out = {}
# Without named_parameters the optimizer names parameters param.G.I; the selection, built from
# the model, keeps its own names and still finds every parameter.
sel = hvd.LayerSelection.hyper(model, fraction=0.5, hidden=4)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layer_selection=sel)
opt.zero_grad()
model(torch.randn(2, 3)).sum().backward()
opt.step()
out["unnamed_ok"] = sorted(w for w in sel.acc.waited) == [0, 0, 1, 1]
other = torch.nn.Linear(3, 3)
for what, build in [
        ("not_owned", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(list(model.parameters())[:4], lr=0.1),
            layer_selection=hvd.LayerSelection.hyper(model, fraction=0.5))),
        ("not_in_model", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1),
            layer_selection=hvd.LayerSelection.hyper(model, fraction=0.5))),
        ("fraction", lambda: hvd.LayerSelection.norm(0.0)),
        ("no_params", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
            layer_selection=hvd.LayerSelection.hyper(torch.nn.ReLU()))),
        # without names every parameter was one layer (param.0.I): all of it travelled
        ("unnamed", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), layer_selection=hvd.LayerSelection.norm(0.5))),
        # Adasum's local steps run in hooks, which selection does not register: nothing moved
        ("adasum", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            op=hvd.Adasum, layer_selection=hvd.LayerSelection.norm(0.5))),
        ("add_param_group", lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            layer_selection=hvd.LayerSelection.norm(0.5)).add_param_group(
                {"params": list(other.parameters())}))]:
    try:
        build()
        out[what] = "no error"
    except ValueError as exc:
        out[what] = str(exc)
report(out)
'''


def test_bad_input_raises_value_error_naming_it_on_every_rank(tmp_path):
    res = run_ranks(2, OWNERSHIP, tmp_path, timeout=120)
    for r in res:
        assert r["unnamed_ok"] is True
        assert "not owned by the optimizer" in r["not_owned"]
        assert "does not have" in r["not_in_model"] and "param.0.8" in r["not_in_model"]
        assert "fraction=0.0" in r["fraction"]
        assert "no parameters" in r["no_params"]
        assert "without named_parameters= there are none" in r["unnamed"]
        assert "op=Adasum is not supported" in r["adasum"]
        assert "cannot take parameters after it is built" in r["add_param_group"]


SAME_BATCHES = r'''
import torch
import fusionring.torch as hvd
hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)])
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(),
                               compression=hvd.Compression.nm(2, 4, shared_mask=False),
                               layer_selection=hvd.LayerSelection.norm(0.5))
for step in range(8):
    g = torch.Generator().manual_seed(100 * rank + step)
    opt.zero_grad()
    model(torch.randn(5, 24, generator=g)).square().mean().backward()
    opt.step()
report({"bits": [p.detach().numpy().tobytes().hex() for p in model.parameters()]})
'''


def test_chosen_layers_travel_as_one_group_so_runs_repeat_bit_for_bit(tmp_path):
    """With per-rank N:M masks the fused batch decides which elements share a group of M:
    the chosen layers go as one group, so two runs with very different cycle times (which
    change how threshold fusion would batch them) give the same bits."""
    runs = [run_ranks(2, SAME_BATCHES, tmp_path / f"cycle{ms}",
                      env={"FUSIONRING_CYCLE_TIME_MS": str(ms)})
            for ms in ("0.05", "40")]
    assert runs[0][0]["bits"] == runs[1][0]["bits"] == runs[0][1]["bits"]


BROADCAST_KEEPS_OWN = '''
import torch
import fusionring.torch as hvd
hvd.init()
rank = hvd.rank()
torch.set_default_dtype(torch.float64)

def run(broadcast_at):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(8)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   layer_selection=hvd.LayerSelection.hyper(model, fraction=0.25,
                                                                            hidden=8, lr=0.1))
    for step in range(24):
        if step == broadcast_at:
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        g = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad()
        (model(torch.randn(4, 6, generator=g)) * (1 + 3 * rank)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]

plain, broadcast = run(None), run(6)
report({"same": all(torch.equal(a, b) for a, b in zip(plain, broadcast))})
'''


def test_broadcast_optimizer_state_keeps_each_ranks_own_hypernetwork(tmp_path):
    # The hypernetwork trains on each rank's own gradients, as the residuals are each rank's:
    # a broadcast mid-run (TorchState.sync() makes one) changes neither.
    for out in run_ranks(2, BROADCAST_KEEPS_OWN, tmp_path, timeout=120):
        assert out["same"]


RESUME = '''
import os
import torch
import fusionring.torch as hvd
hvd.init()
rank = hvd.rank()
MODE, COMP, DIR = os.environ["MODE"], os.environ["COMP"], os.environ["CKPT"]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
compression = (hvd.Compression.nm(2, 4, shared_mask=False) if COMP == "nm"
               else hvd.Compression.cluster(k=4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=compression,
                               layer_selection=hvd.LayerSelection.norm(0.5))
path = os.path.join(DIR, f"rank{rank}.pt")
steps = range(12) if MODE == "full" else range(6) if MODE == "first" else range(6, 12)
if MODE == "second":
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
for step in steps:
    g = torch.Generator().manual_seed(100 * rank + step)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
if MODE == "first":
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
report([p.detach().numpy().tobytes().hex() for p in model.parameters()])
'''


@pytest.mark.parametrize("comp", ["nm", "cluster"])
def test_a_resumed_run_with_per_rank_masks_continues_bit_for_bit(tmp_path, comp):
    # The chosen layers are laid out in layer order, not in the order a job first negotiated
    # their names, which the resumed job meets afresh.
    env = {"COMP": comp, "CKPT": str(tmp_path)}
    full = run_ranks(2, RESUME, tmp_path / "full", timeout=120, env=dict(env, MODE="full"))
    run_ranks(2, RESUME, tmp_path / "first", timeout=120, env=dict(env, MODE="first"))
    resumed = run_ranks(2, RESUME, tmp_path / "second", timeout=120, env=dict(env, MODE="second"))
    assert resumed == full


SUM_OP = r'''
import torch
import fusionring.torch as hvd
hvd.init()
rank = hvd.rank()
torch.set_default_dtype(torch.float64)

def run(selection):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Sum,
                                   layer_selection=selection)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

dense, selected = run(None), run(hvd.LayerSelection.norm(1.0))
report({"diff": (dense - selected).abs().max().item(), "dense_repeat": (dense - run(None)).abs().max().item()})
'''


def test_op_sum_with_every_layer_selected_equals_dense_sum(tmp_path):
    """Layer selection averaged whatever op was given: op=Sum moved the parameters half as far."""
    for r in run_ranks(2, SUM_OP, tmp_path, timeout=120):
        assert r["diff"] < 1e-12 and r["dense_repeat"] == 0.0, r
