"""The Horovod-compatible API at several ranks, checked against local references."""
import pytest

from conftest import run_ranks

API = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}

# allgather with a different first dimension on every rank, and a 0-d tensor
g = hvd.allgather(torch.full((r + 1, 3), float(r)), name="rows")
out["allgather"] = torch.equal(g, torch.cat([torch.full((k + 1, 3), float(k)) for k in range(P)]))
out["allgather_scalar"] = hvd.allgather(torch.tensor(r * 1.5)).tolist() == [k * 1.5 for k in range(P)]
bf = hvd.allgather(torch.full((2,), float(r), dtype=torch.bfloat16))
out["allgather_bf16"] = bf.float().tolist() == sum([[float(k)] * 2 for k in range(P)], [])

# broadcast: new tensor, in place, from a non-zero root
root = P - 1
b = hvd.broadcast(torch.arange(5.0) + r, root_rank=root, name="b")
out["broadcast"] = torch.equal(b, torch.arange(5.0) + root)
t = torch.zeros(4, dtype=torch.int64) + r
hvd.broadcast_(t, root_rank=root, name="b_")
out["broadcast_"] = t.tolist() == [root] * 4

# async + poll + synchronize, several in flight at once
handles = [hvd.allreduce_async(torch.full((10,), float(r + i)), name=f"a{i}", op=hvd.Sum)
           for i in range(5)]
results = [hvd.synchronize(h) for h in handles]
out["async"] = all(torch.equal(x, torch.full((10,), float(sum(range(P)) + P * i)))
                   for i, x in enumerate(results))
h = hvd.allreduce_async_(torch.ones(3), name="polled")
while not hvd.poll(h):
    pass
out["poll"] = hvd.synchronize(h).tolist() == [1.0, 1.0, 1.0]

# grouped allreduce
ts = [torch.full((n,), float(r)) for n in (1, 100, 7)]
gs = hvd.grouped_allreduce(ts, name="grp", op=hvd.Sum)
out["grouped"] = all(torch.equal(x, torch.full_like(x, float(sum(range(P))))) for x in gs)
gs_ = hvd.grouped_allreduce_([t.clone() for t in ts], op=hvd.Max)
out["grouped_"] = all(torch.equal(x, torch.full_like(x, float(P - 1))) for x in gs_)

# non-contiguous input: in place and out of place
base = torch.arange(12.0).reshape(3, 4) + r
view = base.t()
res = hvd.allreduce(view, op=hvd.Sum, name="noncontig")
expect = (torch.arange(12.0).reshape(3, 4) * P + sum(range(P))).t()
hvd.allreduce_(view, op=hvd.Sum, name="noncontig_")
out["noncontiguous"] = torch.equal(res, expect) and torch.equal(view, expect)

# the deprecated average flag and fp16 compression
avg = hvd.allreduce(torch.full((4,), float(r)), average=False, name="avgflag")
out["average_flag"] = avg.tolist() == [float(sum(range(P)))] * 4
c = hvd.allreduce(torch.full((8,), float(r) + 0.5), name="fp16", compression=hvd.Compression.fp16)
out["fp16"] = c.dtype == torch.float32 and torch.allclose(c, torch.full((8,), (sum(range(P)) + 0.5 * P) / P))

# autograd through allreduce / allgather / broadcast
x = torch.full((3,), float(r + 1), requires_grad=True)
y = hvd.allreduce(x, op=hvd.Sum, name="ad")
(y * (r + 1)).sum().backward()
out["grad_allreduce"] = x.grad.tolist() == [float(sum(k + 1 for k in range(P)))] * 3
x2 = torch.ones(r + 1, 2, requires_grad=True)
hvd.allgather(x2, name="ag_grad").sum().backward()
out["grad_allgather"] = torch.equal(x2.grad, torch.full((r + 1, 2), 1.0))  # averaged
x3 = torch.ones(2, requires_grad=True)
hvd.broadcast(x3, root_rank=0, name="bc_grad").sum().backward()
out["grad_broadcast"] = x3.grad.tolist() == ([1.0] * 2 if r == 0 else [0.0, 0.0])  # averaged

# objects, parameters, optimizer state
out["object"] = hvd.broadcast_object({"k": [r]}, root_rank=0) == {"k": [0]}
out["allgather_object"] = hvd.allgather_object(("x", r)) == [("x", k) for k in range(P)]
torch.manual_seed(r)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
flat = torch.cat([v.float().flatten() for v in model.state_dict().values()])
out["parameters"] = all(torch.equal(flat, f) for f in hvd.allgather_object(flat))
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
model(torch.randn(5, 3)).sum().backward()
opt.step()
hvd.broadcast_optimizer_state(opt, root_rank=0)
states = hvd.allgather_object(opt.state_dict())
out["optimizer_state"] = all(s["param_groups"][0]["lr"] == 0.01 for s in states) and all(
    torch.equal(s["state"][0]["exp_avg"], states[0]["state"][0]["exp_avg"]) for s in states)

hvd.barrier()
out["sizes"] = (hvd.size(), hvd.local_size(), hvd.rank(), hvd.local_rank(), hvd.cross_size())
report(out)
'''


@pytest.mark.parametrize("np_", [1, 3])
def test_horovod_api_semantics(np_, tmp_path):
    results = run_ranks(np_, API, tmp_path, timeout=120)
    for rank, out in enumerate(results):
        sizes = out.pop("sizes")
        assert sizes[0] == np_ and sizes[2] == rank and sizes[1] * sizes[4] == np_
        failed = [k for k, v in out.items() if v is not True]
        assert failed == [], f"rank {rank} failed: {failed}"


SYNC_BN = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
results = []
for shape, affine in [((4, 3, 5), True), ((4, 3), True), ((4, 3, 2, 3, 2), False)]:
    g = torch.Generator().manual_seed(5)
    full = torch.randn(P * shape[0], *shape[1:], generator=g) * 3 + 1
    mine = full[r * shape[0]:(r + 1) * shape[0]].clone().requires_grad_(True)
    bn = hvd.SyncBatchNorm(3, affine=affine)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5])); bn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    out = bn(mine)
    (out * torch.arange(out.numel()).view_as(out).float() / 100).sum().backward()
    results.append({"out": out.detach().tolist(), "grad_in": mine.grad.tolist(),
                    "grad_w": hvd.allreduce(bn.weight.grad, op=hvd.Sum).tolist() if affine else None,
                    "grad_b": hvd.allreduce(bn.bias.grad, op=hvd.Sum).tolist() if affine else None,
                    "running_mean": bn.running_mean.tolist(), "running_var": bn.running_var.tolist()})
report(results)
'''


def test_sync_batch_norm_equals_batch_norm_on_the_global_batch(tmp_path):
    import torch

    P = 3
    results = run_ranks(P, SYNC_BN, tmp_path, timeout=60)
    cases = [((4, 3, 5), True), ((4, 3), True), ((4, 3, 2, 3, 2), False)]
    for case, (shape, affine) in enumerate(cases):
        g = torch.Generator().manual_seed(5)
        full = (torch.randn(P * shape[0], *shape[1:], generator=g) * 3 + 1).requires_grad_(True)
        bn = torch.nn.BatchNorm1d(3, affine=affine)
        if affine:
            with torch.no_grad():
                bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
                bn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
        bn._check_input_dim = lambda x: None  # the reference also takes the 5-D case
        out = bn(full)
        weights = torch.cat([torch.arange(out.numel() // P).view(shape).float() / 100] * P)
        (out * weights).sum().backward()
        for r, got in enumerate(result[case] for result in results):
            part = slice(r * shape[0], (r + 1) * shape[0])
            assert torch.allclose(torch.tensor(got["out"]), out[part], atol=1e-5)
            assert torch.allclose(torch.tensor(got["grad_in"]), full.grad[part], atol=1e-5)
            if affine:
                assert torch.allclose(torch.tensor(got["grad_w"]), bn.weight.grad, atol=1e-4)
                assert torch.allclose(torch.tensor(got["grad_b"]), bn.bias.grad, atol=1e-4)
            assert torch.allclose(torch.tensor(got["running_mean"]), bn.running_mean, atol=1e-5)
            assert torch.allclose(torch.tensor(got["running_var"]), bn.running_var, atol=1e-5)


SYNC_BN_OFFSET = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
sizes = [2 + k for k in range(P)]  # uneven batches
g = torch.Generator().manual_seed(9)
full = torch.randn(sum(sizes), 3, 6, generator=g) + 1000.0  # large mean, unit spread
start = sum(sizes[:r])
mine = full[start:start + sizes[r]].clone().requires_grad_(True)
bn = hvd.SyncBatchNorm(3)
out = bn(mine)
out.pow(2).sum().backward()
report({"out": out.detach().tolist(), "grad_in": mine.grad.tolist(),
        "running_var": bn.running_var.tolist(), "start": start})
'''


def test_sync_batch_norm_keeps_its_precision_when_the_mean_is_large(tmp_path):
    # Sums of x and x*x cancel in float32 at a mean of 1000 (the outputs were off by 0.14).
    import torch

    P = 3
    results = run_ranks(P, SYNC_BN_OFFSET, tmp_path, timeout=60)
    sizes = [2 + k for k in range(P)]
    g = torch.Generator().manual_seed(9)
    full = (torch.randn(sum(sizes), 3, 6, generator=g) + 1000.0).double().requires_grad_(True)
    bn = torch.nn.BatchNorm1d(3).double()
    out = bn(full)
    out.pow(2).sum().backward()
    for r, got in enumerate(results):
        part = slice(got["start"], got["start"] + sizes[r])
        assert torch.allclose(torch.tensor(got["out"]).double(), out[part], atol=2e-4)
        assert torch.allclose(torch.tensor(got["grad_in"]).double(), full.grad[part], atol=2e-3)
        assert torch.allclose(torch.tensor(got["running_var"]).double(), bn.running_var,
                              rtol=1e-4)


IDLE = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="warm")
before = hvd.communication_stats()["cycles"]
time.sleep(1.0)
idle_cycles = hvd.communication_stats()["cycles"] - before
if hvd.rank() == 1:
    time.sleep(0.3)  # rank 0 submits first and waits for rank 1
t = time.perf_counter()
out = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Sum, name="late")
report({"idle_cycles": idle_cycles, "sum": out.tolist(), "waited": time.perf_counter() - t})
'''


def test_idle_ranks_do_not_cycle_and_a_late_submission_is_agreed_at_once(tmp_path):
    """With nothing in flight anywhere, the control loops wait for a submission instead of
    agreeing on nothing every few ms; the rank that submits last gets its result at once."""
    results = run_ranks(2, IDLE, tmp_path, timeout=60)
    for rank, got in enumerate(results):
        # 1 s idle at one cycle per 50 ms is about 20 (it was ~145 with timed cycles).
        assert got["idle_cycles"] <= 30, (rank, got)
        assert got["sum"] == [3.0, 3.0, 3.0]
    assert results[1]["waited"] < 0.25, results
    assert 0.2 < results[0]["waited"] < 0.8, results


BLOCKING_SEQUENCE = r'''
import time, torch
import fusionring.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="warm")
before = hvd.communication_stats()["cycles"]
sums = []
for i in range(40):
    time.sleep(0.005)  # a little compute between blocking calls, longer than a cycle
    sums.append(hvd.allreduce(torch.full((3,), float(hvd.rank() + i)), op=hvd.Sum,
                              name="metric").tolist())
report({"cycles": hvd.communication_stats()["cycles"] - before, "sums": sums})
'''


def test_blocking_calls_cost_one_agreement_round_each(tmp_path):
    """Once a round's tensors were all ready everywhere, no round runs until the next
    submission: a blocking call between bits of compute costs one round, not a timed
    empty round after it as well (that was 80 rounds for these 40 calls)."""
    results = run_ranks(2, BLOCKING_SEQUENCE, tmp_path, timeout=60)
    for rank, got in enumerate(results):
        assert got["cycles"] <= 50, (rank, got["cycles"])
        assert got["sums"] == [[float(2 * i + 1)] * 3 for i in range(40)]


STUCK_ON_DIFFERENT_TENSORS = r'''
import os, threading, time, torch
import fusionring.torch as hvd
from fusionring import state as runtime
hvd.init()
rt = runtime.get()
handle = hvd.allreduce_async(torch.ones(3), name=f"only_on_rank_{hvd.rank()}")
def wait():
    try:
        hvd.synchronize(handle)
    except Exception:
        pass
threading.Thread(target=wait, daemon=True).start()
time.sleep(0.3)
before, t = rt.stats.cycles, time.monotonic()
time.sleep(1.0)
report({"rounds_per_s": (rt.stats.cycles - before) / (time.monotonic() - t)})
os._exit(0)  # the tensors can never be agreed; leave without the shutdown round
'''


def test_ranks_waiting_on_different_tensors_keep_to_timed_rounds(tmp_path):
    """A blocked caller gets back-to-back rounds only briefly: ranks stuck on tensors that
    can never be agreed go back to one round per cycle (not ~12 000 per second)."""
    # Leaving through os._exit is an abnormal end for Open MPI's launcher (not for MPICH's), so
    # the exit status is not asserted; every rank's report is.
    results, _, output = run_ranks(2, STUCK_ON_DIFFERENT_TENSORS, tmp_path, timeout=60,
                                   env={"FUSIONRING_STALL_WARNING_S": "100"},
                                   expect_failure=True)
    assert all(got is not None for got in results), output
    for rank, got in enumerate(results):
        assert got["rounds_per_s"] < 2000, (rank, got)
