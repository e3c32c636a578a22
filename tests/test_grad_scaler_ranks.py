"""torch.amp.GradScaler used the plain torch way with a DistributedOptimizer:
``scaler.step(opt)``, ``scaler.unscale_(opt)`` before clipping, and a fused optimizer (the
scaler's ``_step_supports_amp_scaling`` path), with an overflow on one rank and on every rank.
The reference is one process on the global batch with its own GradScaler; Horovod's recipe
(synchronize, unscale_, step inside skip_synchronize) must stay as it was."""
import pytest

from conftest import run_ranks

SCALER = r'''
import sys, warnings
import torch
import fusionring.torch as hvd

hvd.init()
r, P = hvd.rank(), hvd.size()
STEPS, OVERFLOW = 6, 2
out = {}

def data(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

def optimizer(kind, params):
    if kind == "fused":
        return torch.optim.Adam(params, lr=0.01, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

def loss_of(net, step, rank, who):
    x, y = data(step, rank)
    loss = ((net(x) - y) ** 2).mean()
    if step == OVERFLOW and (who == "all" or rank == who):
        loss = loss * float("inf")
    return loss

def one_step(scaler, opt, net, loss, recipe):
    scaler.scale(loss).backward()
    if recipe == "plain":
        scaler.step(opt)
    elif recipe == "clip":
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        scaler.step(opt)
    else:  # Horovod's recipe
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        with opt.skip_synchronize():
            scaler.step(opt)
    scaler.update()

def run(kind, recipe, who):
    net = model()
    opt = hvd.DistributedOptimizer(optimizer(kind, net.parameters()),
                                   named_parameters=net.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    ref = model()
    ref_opt = optimizer(kind, ref.parameters())
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    worst, scales = 0.0, []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            one_step(scaler, opt, net, loss_of(net, step, r, who), recipe)
            ref_opt.zero_grad()
            total = sum(loss_of(ref, step, rank, who) / P for rank in range(P))
            one_step(ref_scaler, ref_opt, ref, total, "plain" if recipe == "plain" else "clip")
            worst = max(worst, max((a - b).abs().max().item()
                                   for a, b in zip(net.parameters(), ref.parameters())))
            scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    synchronize_warnings = [str(w.message) for w in seen if "skip_synchronize" in str(w.message)]
    return {"worst": worst, "scales": scales, "warnings": synchronize_warnings,
            "params": [p.detach().reshape(-1).tolist() for p in net.parameters()]}

for kind in ("sgd", "fused"):
    for recipe in ("plain", "clip", "horovod"):
        for who in (-1, 1, "all"):
            out[f"{kind}/{recipe}/{who}"] = run(kind, recipe, who)
report(out)
'''


def test_grad_scaler_the_plain_torch_way_matches_one_process(tmp_path):
    outs = run_ranks(2, SCALER, tmp_path, timeout=240)
    for case, got in outs[0].items():
        for rank_out in outs:
            mine = rank_out[case]
            # float32 SGD/Adam on the same sums as the single process: rounding only
            assert mine["worst"] < 1e-5, (case, mine["worst"])
            # the same steps skipped, so the same scale, on every rank and in the reference
            assert all(a == b for a, b in mine["scales"]), (case, mine["scales"])
            assert mine["warnings"] == [], (case, mine["warnings"])
            assert mine["params"] == got["params"], case  # replicas identical
        overflowed = not case.endswith("/-1")
        halved = got["scales"][-1][0] == 2.0 ** 7
        assert halved == overflowed, (case, got["scales"])
