"""The server steps the wrapped optimizer's own class: SGD with momentum and weight decay, Adam, and an LR
scheduler on the workers (on the optimizer wrapped or on the wrapper; a float or a tensor lr) give, under bsp, what one process gets from the averaged gradients."""
import pytest

from conftest import run_ranks

SCRIPT = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {{"server": True}})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()

def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))

def make(params):
    return {make}

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)

model = build(100 + k)  # worker 0's initial parameters win
inner = make(model.parameters())
sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.3) if {scheduled!r} == "inner" else None
opt = ps.DistributedOptimizer(inner, named_parameters=model.named_parameters(), sync="bsp")
if {scheduled!r} == "wrapper":  # as with Horovod's optimizer: the scheduler takes the wrapped one
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
ref = build(100)
ref_opt = make(ref.parameters())
ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.3) if {scheduled!r} else None
flat = build(100)  # the same run with the lr never scheduled: the schedule must make a difference
flat_opt = make(flat.parameters())
import warnings
warned = []
for step in range(7):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    if sched is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        warned += [str(w.message) for w in caught]
    for net, o, s in ((ref, ref_opt, ref_sched), (flat, flat_opt, None)):
        grads = []
        for j in range(W):
            net.zero_grad(); xj, yj = batch(j, step)
            torch.nn.functional.mse_loss(net(xj), yj).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for i, p in enumerate(net.parameters()):
            p.grad = sum(g[i] for g in grads) / W
        o.step()
        if s is not None:
            s.step()
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
flat_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), flat.parameters()))
ps.shutdown()
report({{"diff": diff, "flat_diff": flat_diff, "lr": float(inner.param_groups[0]["lr"]), "warned": warned}})
'''

CASES = {
    "sgd_momentum_weight_decay": ("torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01, "
                                  "nesterov=True)", False),
    "adam_weight_decay": "torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95), weight_decay=0.02)",
    "adamw": "torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)",
    "sgd_step_lr": ("torch.optim.SGD(params, lr=0.2, momentum=0.5)", "inner"),
    "sgd_step_lr_on_the_wrapper": ("torch.optim.SGD(params, lr=0.2, momentum=0.5)", "wrapper"),
    # a one-value tensor lr, which the scheduler fills in place
    "adam_tensor_lr_step_lr": ("torch.optim.Adam(params, lr=torch.tensor(0.2))", "inner"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bsp_server_steps_the_wrapped_optimizer_as_one_process_would(tmp_path, case):
    spec = CASES[case]
    make, scheduled = spec if isinstance(spec, tuple) else (spec, "")
    results = run_ranks(3, SCRIPT.format(make=make, scheduled=scheduled), tmp_path, timeout=150)
    assert results[0] == {"server": True}
    for r in results[1:]:
        assert r["diff"] < 1e-6, r
        assert r["warned"] == [], r  # the scheduler sees its optimizer stepped (on the servers)
        if scheduled:
            # the workers' schedule reached the server: without it the parameters would be elsewhere
            assert r["flat_diff"] > 1e-3 and abs(r["lr"] - 0.2 * 0.3 ** 3) < 1e-8, r  # float32 for the tensor lr


DIFFERING_LR = r'''
import torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1, bias=False)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 if k == 0 else 0.5),
                              named_parameters=model.named_parameters(), sync="bsp")
initial = model.weight.detach().clone()
for _ in range(3):
    opt.zero_grad(); model(torch.ones(1, 3)).sum().backward(); opt.step()
ps.shutdown()
report({"moved": (model.weight.detach() - initial).tolist()})
'''


def test_workers_with_different_hyper_parameters_are_warned_about(tmp_path):
    results, code, output = run_ranks(3, DIFFERING_LR, tmp_path, timeout=90, expect_failure=True)
    assert code == 0, output[-3000:]
    assert "different hyper-parameters: worker 1 group 0 lr=0.5 (worker 0: 0.1)" in output, output[-3000:]
    # bsp steps with the round's highest-numbered worker's lr: 3 steps of gradient 1 at lr 0.5
    for worker in results[1:]:
        assert worker["moved"][0] == pytest.approx([-1.5, -1.5, -1.5], abs=1e-6), results
