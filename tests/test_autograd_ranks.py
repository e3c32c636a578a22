"""Autograd through the collectives: second order, threads and overlapping process sets.

References are computed on every rank from every rank's seeded input, by Horovod's backward
rules (the backward of an allreduce is the same allreduce of the output gradient).
"""
from conftest import run_ranks

SECOND_ORDER = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
xs = [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(P)]
x = xs[r].clone().requires_grad_()
out = {}
# loss = |A(x)|^2 + sum(x^3) with A the averaging allreduce: dloss/dx = A(2 A(x)) + 3x^2, and
# the sum of that over the elements has gradient A(A(2)) + 6x = 2 + 6x on every rank.
avg = torch.stack(xs).mean(0)
(g,) = torch.autograd.grad((hvd.allreduce(x, name="second") ** 2).sum() + (x ** 3).sum(), x,
                           create_graph=True)
out["first"] = torch.allclose(g, 2 * avg + 3 * xs[r] ** 2, rtol=0, atol=1e-12)
g.sum().backward()
out["second"] = torch.allclose(x.grad, 2 + 6 * xs[r], rtol=0, atol=1e-12)
# The same through allgather and broadcast (each rank's rows of an averaged gradient).
y = xs[r].clone().requires_grad_()
(h,) = torch.autograd.grad((hvd.allgather(y, name="gathered") ** 2).sum(), y, create_graph=True)
out["gather first"] = torch.allclose(h, 2 * y.detach(), rtol=0, atol=1e-12)
h.sum().backward()
out["gather second"] = torch.allclose(y.grad, torch.full_like(y, 2.0 / P), rtol=0, atol=1e-12)
# Unnamed, through a process set of every rank but the last (at 3 ranks and more).
members = list(range(P - 1)) if P > 2 else list(range(P))
part = hvd.add_process_set(members) if P > 2 else None
if r in members:
    z = xs[r].clone().requires_grad_()
    (k,) = torch.autograd.grad((hvd.allreduce(z, op=hvd.Sum, process_set=part) ** 2).sum(), z,
                               create_graph=True)
    k.sum().backward()
    n = len(members)
    out["set second"] = torch.allclose(z.grad, torch.full_like(z, 2.0 * n * n), rtol=0, atol=1e-12)
report(out)
'''


def test_second_order_gradients_run_through_the_collectives(tmp_path):
    for np in (2, 3):
        for r, out in enumerate(run_ranks(np, SECOND_ORDER, tmp_path, timeout=90)):
            assert all(v is True for v in out.values()), out
            assert len(out) == (4 if np > 2 and r == np - 1 else 5), out


CONCURRENT = r'''
import threading
import torch
import fusionring.torch as hvd
low, high = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[low, high])
r = hvd.rank()
out = {"threads": [], "sets": []}

# Threads: each backward's allreduce is named after its forward, so the ranks pair them up
# whatever order the threads run in.
def worker(tid):
    for i in range(15):
        x = torch.ones(3, requires_grad=True)
        y = hvd.allreduce(x, op=hvd.Sum, name=f"t{tid}.{i}")
        (y * (tid + 1)).sum().backward()
        if not torch.equal(x.grad, torch.full((3,), 3.0 * (tid + 1))):
            out["threads"].append([tid, i, x.grad.tolist()])

threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()

# Overlapping sets: rank 1 runs the low set's operations before the high set's; unnamed
# operations are counted per set, so it agrees with rank 0 on the low set and with rank 2
# on the high set.
for s in ([low, high] if r == 1 else [low] if r == 0 else [high]):
    x = torch.full((2,), float(r + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, process_set=s)
    y.sum().backward()
    plain = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum, process_set=s)
    out["sets"].append([y.tolist(), x.grad.tolist(), plain.tolist()])
report(out)
'''


def test_concurrent_backward_passes_pair_up_by_name(tmp_path):
    results = run_ranks(3, CONCURRENT, tmp_path, timeout=120,
                        env={"FUSIONRING_STALL_WARNING_S": "5", "FUSIONRING_STALL_SHUTDOWN_S": "20"})
    for out in results:
        assert out["threads"] == [], out
    assert results[0]["sets"] == [[[3.0, 3.0], [2.0, 2.0], [1.0, 1.0]]]
    assert results[1]["sets"] == [[[3.0, 3.0], [2.0, 2.0], [1.0, 1.0]],
                                  [[5.0, 5.0], [2.0, 2.0], [3.0, 3.0]]]
    assert results[2]["sets"] == [[[5.0, 5.0], [2.0, 2.0], [3.0, 3.0]]]


AVERAGE = r'''
import warnings
import torch
import fusionring.torch as hvd
hvd.init()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    total = hvd.allreduce(torch.ones(2), average=False, name="old.style")
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="new.style")
report({"total": total.tolist(), "warnings": [str(w.message) for w in caught
                                             if issubclass(w.category, DeprecationWarning)]})
'''


def test_average_argument_warns_as_horovod(tmp_path):
    for out in run_ranks(2, AVERAGE, tmp_path, timeout=60):
        assert out == {"total": [2.0, 2.0], "warnings": [
            "Parameter `average` has been replaced with `op` and will be removed in v1.0"]}
