"""The parameter server at several ranks: each sync mode against a single-process reference, faults, bad input."""
import time

import pytest

from conftest import run_ranks

# Server ranks leave inside ps.init(); they report from an exit hook (run before mpi4py's own).
PRELUDE = r'''
import atexit, sys, time, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import ps
S = int(sys.argv[1]) if len(sys.argv) > 1 else 1
'''

BSP = PRELUDE + r'''
S = {servers}
if MPI.COMM_WORLD.Get_rank() < S:
    atexit.register(report, {{"server": True}})
ps.init(num_servers=S)
W, k = ps.num_workers(), ps.worker_rank()

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)

torch.manual_seed(100 + k)  # worker 0's initial parameters must win
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              named_parameters=model.named_parameters(), sync="bsp")
torch.manual_seed(100)  # the reference starts from worker 0's parameters
ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
for step in range(6):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    # reference: every worker's gradient at the same parameters, averaged, one local step
    grads = []
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    for i, p in enumerate(ref.parameters()):
        p.grad = sum(g[i] for g in grads) / W
    ref_opt.step()
diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
s = ps.stats()
ps.shutdown()
report({{"diff": diff, "pushes": s["pushes"], "staleness_max": s["staleness_max"], "moved":
        max((a - b).abs().max().item() for a, b in zip(model.parameters(), build().parameters()))}})
'''


@pytest.mark.parametrize("np_, servers", [(3, 1), (5, 2)])
def test_bsp_equals_single_process_sgd_on_averaged_gradients(tmp_path, np_, servers):
    results = run_ranks(np_, BSP.format(servers=servers), tmp_path, timeout=120)
    workers = results[servers:]
    assert all(r == {"server": True} for r in results[:servers])
    for r in workers:
        assert r["diff"] < 1e-6, r
        assert r["pushes"] == 6 and r["staleness_max"] == 0
        assert r["moved"] > 1e-3  # training changed the parameters


STALENESS = PRELUDE + r'''
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {{"server": True}})
ps.init(num_servers=1)
k = ps.worker_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters(), sync="{sync}", staleness=2)
for epoch in range(2):
    for step in range(15):
        if k == 1:
            time.sleep(0.03)  # the straggler
        opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
    opt.end_epoch()
s = ps.stats()
ps.shutdown()
report(s)
'''


def test_ssp_keeps_every_worker_within_the_staleness_bound(tmp_path):
    results = run_ranks(3, STALENESS.format(sync="ssp"), tmp_path, timeout=120)
    fast, slow = results[1], results[2]
    assert fast["ahead_max"] <= 2 and slow["ahead_max"] <= 2
    assert fast["waits"] > 0  # the fast worker was held back for the straggler
    assert fast["pushes"] == slow["pushes"] == 30


def test_asp_lets_the_fast_worker_run_ahead(tmp_path):
    results = run_ranks(3, STALENESS.format(sync="asp"), tmp_path, timeout=120)
    fast, slow = results[1], results[2]
    assert fast["waits"] == 0 and slow["waits"] == 0
    assert fast["ahead_max"] > 2  # no bound: the same straggler is left behind
    assert slow["staleness_max"] > 1  # the straggler's gradients are applied to newer parameters


def test_adaptive_runs_to_the_end_with_a_straggler(tmp_path):
    results = run_ranks(3, STALENESS.format(sync="adaptive"), tmp_path, timeout=120)
    assert results[1]["pushes"] == results[2]["pushes"] == 30
    for change in results[1]["group_changes"]:
        assert set(change) >= {"update", "s", "sync_group", "async"}


DEAD = PRELUDE + r'''
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp")
for step in range(50):
    if k == 1 and step == 2:
        sys.exit(0)  # leaves without ps.shutdown()
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
ps.shutdown()
'''


def test_a_worker_that_leaves_without_shutdown_is_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    _, rc, output = run_ranks(3, DEAD, tmp_path, timeout=100, expect_failure=True,
                              env={"FUSIONRING_STALL_SHUTDOWN_S": "3"})
    assert rc != 0
    assert "worker 1 (rank 2)" in output and "StallError" in output
    assert time.monotonic() - start < 60


BAD = PRELUDE + r'''
try:
    ps.init(num_servers=3)
    too_many = None
except ValueError as e:
    too_many = str(e)
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
model = torch.nn.Linear(3, 1)
sgd = torch.optim.SGD(model.parameters(), lr=0.1)
errors = {"num_servers": too_many}
for arg, kwargs in [("sync", {"sync": "fast"}), ("staleness", {"staleness": -1}),
                    ("staleness", {"staleness": 1.5}), ("slack", {"slack": -2.0}),
                    ("compression", {"compression": hvd.Compression.nm(2, 4, shared_mask=True)}),
                    ("named_parameters", {"named_parameters": None})]:
    kwargs.setdefault("named_parameters", model.named_parameters())
    try:
        ps.DistributedOptimizer(sgd, **kwargs)
        errors[arg + repr(kwargs.get(arg))] = None
    except ValueError as e:
        errors[arg + repr(kwargs.get(arg))] = str(e)
opt = ps.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), sync="asp",
                              compression=hvd.Compression.nm(2, 4, shared_mask=False))
try:  # the servers hold the model the optimizer was built with
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    errors["add_param_group"] = None
except ValueError as e:
    errors["add_param_group"] = str(e)
opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
ps.shutdown()
report(errors)
'''


def test_bad_arguments_raise_value_errors_naming_them(tmp_path):
    results = run_ranks(3, BAD, tmp_path, timeout=100)
    for errors in results[1:]:
        assert "num_servers" in errors["num_servers"]
        for key, message in errors.items():
            arg = next(a for a in ("num_servers", "sync", "staleness", "slack", "compression",
                                   "named_parameters", "add_param_group") if key.startswith(a))
            assert message is not None and arg in message, (key, message)


MISMATCH = PRELUDE + r'''
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 2 if k == 0 else 4)
try:
    ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                            named_parameters=model.named_parameters())
    report("no error")
except Exception as e:
    report(type(e).__name__ + ": " + str(e))
    raise
'''


def test_mismatched_models_fail_on_every_rank_naming_the_parameter(tmp_path):
    results, rc, output = run_ranks(3, MISMATCH, tmp_path, timeout=100, expect_failure=True)
    assert rc != 0
    for message in results[1:]:
        assert message.startswith("TensorMismatchError") and "'weight'" in message and "worker 1" in message


WAITS = PRELUDE + r'''
S = {servers}
if MPI.COMM_WORLD.Get_rank() < S:
    atexit.register(report, {{"server": True}})
ps.init(num_servers=S)
k = ps.worker_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters(), sync="bsp")
for step in range(5):
    if k == 1:
        time.sleep(0.3)  # worker 0 pushes first and waits for it every step
    opt.zero_grad(); model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step()
s = ps.stats()
ps.shutdown()
report(s)
'''


@pytest.mark.parametrize("servers", [1, 2])
def test_waits_count_steps_held_back_however_many_servers_held_them(tmp_path, servers):
    results = run_ranks(servers + 2, WAITS.format(servers=servers), tmp_path, timeout=120)
    waiting, last = results[servers], results[servers + 1]
    assert waiting["pushes"] == last["pushes"] == 5
    assert waiting["waits"] == 5 and last["waits"] == 0, (waiting, last)
