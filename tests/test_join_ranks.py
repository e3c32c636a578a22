"""hvd.join() with uneven data, the global process set, num_groups and sparse gradients."""
import pytest
import torch

from conftest import run_ranks

JOIN = r'''
import itertools
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}

# Allreduce while one rank has joined: it contributes zeros, Average divides by size().
for dtype, first, cached in itertools.product([torch.float32, torch.int32, torch.float16],
                                              [0, P - 1], [False, True]):
    torch.manual_seed(1234)
    a = torch.randint(-100, 100, (5, 5)).to(dtype)
    b = torch.randint(-100, 100, (17,)).to(dtype)
    key = f"{dtype}-{first}-{cached}"
    if cached:  # the names are known from an earlier step: the cached path
        hvd.synchronize(hvd.allreduce_async(a, name="ja", op=hvd.Sum))
        hvd.synchronize(hvd.allreduce_async(b, name="jb", op=hvd.Sum))
    if r == first:
        last = hvd.join()
    else:
        ha = hvd.allreduce_async(a, name="ja", op=hvd.Sum)
        hb = hvd.allreduce_async(b, name="jb", op=hvd.Sum)
        sa, sb = hvd.synchronize(ha), hvd.synchronize(hb)
        avg = hvd.allreduce(a.double(), name="javg")  # Average over all P ranks
        out["sum " + key] = (torch.equal(sa, a * (P - 1)) and torch.equal(sb, b * (P - 1)))
        out["avg " + key] = torch.allclose(avg, a.double() * (P - 1) / P)
        last = hvd.join()
    out["last " + key] = last != first and 0 <= last < P

# Uneven data through the DistributedOptimizer: rank r trains r + 1 steps, then joins.
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(r + 1):
    opt.zero_grad()
    x = torch.full((3, 4), float(r + step))
    model(x).sum().backward()
    opt.step()
out["optimizer last"] = hvd.join()
out["weights"] = model.weight.detach().flatten().tolist()

# Allgather while a rank has joined raises on the others, as in Horovod, and they can join.
if r == 0:
    hvd.join()
else:
    try:
        hvd.allgather(torch.full((r, 2), float(r)), name="jg")
        out["allgather error"] = "no error"
    except RuntimeError as exc:
        out["allgather error"] = str(exc)
    hvd.join()
# ...and the same name later, with every rank taking part, is not confused by it.
g = hvd.allgather(torch.full((r + 1, 2), float(r)), name="jg")
out["allgather after"] = torch.equal(g, torch.cat([torch.full((k + 1, 2), float(k))
                                                   for k in range(P)]))

# Broadcast while a rank has joined raises on the others too, whether or not the root is the
# joined rank, and for a name every rank used before (the cached path).
hvd.broadcast(torch.zeros(2), root_rank=1, name="jbc_root")
if r == 1:
    hvd.join()
else:
    for key, root, name in (("broadcast error", 0, "jbc"), ("joined root", 1, "jbc_root")):
        try:
            hvd.broadcast(torch.arange(4.0) + r, root_rank=root, name=name)
            out[key] = "no error"
        except RuntimeError as exc:
            out[key] = str(exc)
    hvd.join()
out["broadcast after"] = torch.equal(
    hvd.broadcast(torch.arange(4.0) + r, root_rank=0, name="jbc"), torch.arange(4.0))

# Still usable afterwards.
out["after"] = hvd.allreduce(torch.ones(3) * r, op=hvd.Sum, name="after").tolist()
report(out)
'''


def _expected_weights(P, steps):
    """Single-process reference: each step averages the gradients of the ranks still training
    (a joined rank counts as zeros) over all P ranks; `steps` is how many steps a rank took."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    for step in range(steps):
        grads = []
        for r in range(P):
            if step > r:
                grads.append(None)  # joined: zeros
                continue
            model.zero_grad()
            model(torch.full((3, 4), float(r + step))).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                total = sum(g[i] for g in grads if g is not None)
                p -= 0.1 * total / P
    return model.weight.detach().flatten().tolist()


@pytest.mark.parametrize("np_", [2, 3])
def test_join(tmp_path, np_):
    results = run_ranks(np_, JOIN, tmp_path, timeout=120)
    for r, out in enumerate(results):
        for key, value in out.items():
            if key.startswith(("sum ", "avg ", "last ", "allgather after", "broadcast after")):
                assert value is True, (r, key)
        # Each rank reduced in the cases where another rank joined first (3 dtypes x 2 x 2).
        assert sum(k.startswith("sum ") for k in out) == 12 - 6 * (r in (0, np_ - 1))
        assert ("allgather error" in out) == (r != 0)
        assert ("broadcast error" in out) == (r != 1)
        if r != 0:  # the joined rank and the tensor named, as each rank sees it
            assert "allgather 'jg'" in out["allgather error"], out["allgather error"]
            assert "rank 0 has called join()" in out["allgather error"]
        assert out["optimizer last"] == np_ - 1  # the rank with the most data joins last
        # A rank's weights stop changing when it joins.
        assert out["weights"] == pytest.approx(_expected_weights(np_, r + 1), rel=1e-5, abs=1e-6)
        if r != 1:
            assert "broadcast 'jbc' (root rank 0)" in out["broadcast error"]
            assert "rank 1 has called join()" in out["broadcast error"]
            assert "root rank 1 has joined" in out["joined root"], out["joined root"]
        assert out["after"] == [float(sum(range(np_)))] * 3


UNNAMED = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {"errors": 0, "joins": [], "gathered": []}
# Each rank joins first once while the others run an unnamed allgather (which must fail)
# and an unnamed broadcast. A rank that skipped those operations numbers its next unnamed
# one differently, so the failure cannot wait for the others' matching names.
for first in range(P):
    if r == first:
        last = hvd.join()
    else:
        for op in (lambda: hvd.allgather(torch.ones(3, 2)),
                   lambda: hvd.broadcast(torch.ones(2), root_rank=r)):
            try:
                op()
            except RuntimeError:
                out["errors"] += 1
        last = hvd.join()
    out["joins"].append(last)
    out["gathered"].append(hvd.allgather_object(last))  # unnamed: the same name everywhere
report(out)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_unnamed_operations_while_a_rank_has_joined_fail_without_a_hang(tmp_path, np_):
    results = run_ranks(np_, UNNAMED, tmp_path, timeout=90)
    for r, out in enumerate(results):
        assert out["errors"] == 2 * (np_ - 1), (r, out)
        for first, (last, gathered) in enumerate(zip(out["joins"], out["gathered"])):
            assert last != first and gathered == [last] * np_, (r, out)


PROCESS_SETS = r'''
import warnings
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}
gs = hvd.global_process_set
out["global"] = [gs.ranks, gs.size(), gs.rank(), gs.included()]
out["allreduce"] = hvd.allreduce(torch.ones(2) * r, op=hvd.Sum, process_set=gs).tolist()
try:
    hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))
    out["subset"] = "no error"
except ValueError as exc:
    out["subset"] = str(exc)
out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()

# num_groups: Horovod's older name for an int `groups`.
model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), num_groups=2,
                                   process_set=gs)
out["deprecated"] = any(issubclass(w.category, DeprecationWarning) for w in caught)
model(torch.full((2, 3), float(r))).sum().backward()
opt.step()
out["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
report(out)
'''


def test_global_process_set_and_num_groups(tmp_path):
    results = run_ranks(2, PROCESS_SETS, tmp_path, timeout=60)
    for r, out in enumerate(results):
        assert out["global"] == [[0, 1], 2, r, True]
        assert out["allreduce"] == [1.0, 1.0]
        assert "process set with ranks [0] has not been added" in out["subset"]
        assert out["after"] == 2.0
        assert out["deprecated"] is True
        assert out["params"] == results[0]["params"]  # averaged gradients: identical models


SPARSE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}
# sparse_allreduce_async: rank r contributes rows r and r + 1 (overlapping across ranks).
dense = torch.zeros(6, 3)
dense[r] = r + 1.0
dense[r + 1] = 10.0 * (r + 1)
h = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)
out["sum"] = hvd.synchronize(h).to_dense().tolist()
h = hvd.sparse_allreduce_async(dense.to_sparse(), op=hvd.Average)
out["avg"] = hvd.synchronize(h).to_dense().tolist()

# An embedding with sparse gradients trained with SparseAdam: gradients stay sparse, with
# and without sparse_as_dense.
for mode in ("sparse", "as_dense"):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    base = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=emb.named_parameters(),
                                   sparse_as_dense=(mode == "as_dense"))
    for step in range(3):
        opt.zero_grad()
        idx = torch.tensor([(r + step) % 10, (2 * r + step + 3) % 10])
        # from step 1 the second row looked up gets a zero gradient: SparseAdam still steps it
        (emb(idx).pow(2).sum(1) * torch.tensor([1.0, float(step == 0)])).sum().backward()
        opt.step()
        out[f"{mode} grad sparse"] = emb.weight.grad.is_sparse
    out[mode] = emb.weight.detach().flatten().tolist()
report(out)
'''


def _sparse_reference(P):
    """Single process: SparseAdam on the average of every rank's sparse gradient."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for step in range(3):
        grads = []
        for r in range(P):
            emb.zero_grad()
            idx = torch.tensor([(r + step) % 10, (2 * r + step + 3) % 10])
            (emb(idx).pow(2).sum(1) * torch.tensor([1.0, float(step == 0)])).sum().backward()
            grads.append(emb.weight.grad.clone())
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        emb.weight.grad = (total / P).coalesce()
        opt.step()
    return emb.weight.detach().flatten().tolist()


def test_sparse_gradients(tmp_path):
    np_ = 3
    sum_ = torch.zeros(6, 3)
    for r in range(np_):
        sum_[r] += r + 1.0
        sum_[r + 1] += 10.0 * (r + 1)
    expected = _sparse_reference(np_)
    for out in run_ranks(np_, SPARSE, tmp_path, timeout=60):
        assert out["sum"] == sum_.tolist()
        assert torch.allclose(torch.tensor(out["avg"]), sum_ / np_)
        assert out["sparse grad sparse"] is True and out["as_dense grad sparse"] is True
        assert out["sparse"] == pytest.approx(expected, abs=1e-6)
        assert out["as_dense"] == pytest.approx(expected, abs=1e-6)
