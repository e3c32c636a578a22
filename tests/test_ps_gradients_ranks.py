"""What a push carries: parameters with no gradient (frozen, or unused in a step) are neither sent nor stepped, as
torch's optimizers skip them, and bsp averages over the workers that had a gradient; sparse gradients travel dense;
float64 models train with the N:M and cluster compressors. Each against a single-process reference."""
import pytest

from conftest import run_ranks

NO_GRAD = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()
OPT = "@OPT@"

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.frozen = torch.nn.Linear(6, 5), torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 3)
        self.mine = torch.nn.Linear(5, 3)    # worker (step % 2) uses it: one gradient per step
        self.rare = torch.nn.Linear(5, 3)    # every worker on steps 0 and 3, nobody otherwise
        self.frozen.requires_grad_(False)    # in the optimizer all the same, as a fine-tuning script may have it

    def forward(self, x, worker, step):
        h = self.frozen(torch.tanh(self.a(x)))
        out = self.head(h)
        if worker == step % 2:
            out = out + self.mine(h)
        if step % 3 == 0:
            out = out + self.rare(h)
        return out

def make(params):
    if OPT == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)

model, ref, initial = Net(), Net(), Net()
opt = ps.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(), sync="bsp")
ref_opt = make(ref.parameters())
sent = 0
for step in range(6):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x, k, step), y).backward()
    sent += sum(p.numel() * 4 for p in model.parameters() if p.grad is not None)
    opt.step()
    # the reference: plain torch on the average over the workers that have a gradient, None where none has
    grads = []
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj, j, step), yj).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()})
    for n, p in ref.named_parameters():
        have = [g[n] for g in grads if g[n] is not None]
        p.grad = sum(have) / len(have) if have else None
    ref_opt.step()
s = ps.stats()
ps.shutdown()
got, want, start = dict(model.named_parameters()), dict(ref.named_parameters()), dict(initial.named_parameters())
report({"diff": {n: (got[n] - want[n]).abs().max().item() for n in got},
        "frozen_moved": max((got[n] - start[n]).abs().max().item() for n in ("frozen.weight", "frozen.bias")),
        "moved": {n: (got[n] - start[n]).abs().max().item() for n in got},
        "bytes_sent": s["bytes_sent"], "expected_sent": sent + (sum(p.numel() * 4 for p in model.parameters())
                                                                if k == 0 else 0)})
'''


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_parameters_without_a_gradient_are_neither_sent_nor_stepped(tmp_path, opt):
    """Momentum, Adam's moments and weight decay leave a parameter with no gradient alone, as in one process:
    the frozen layer never moves, and a layer one worker used is stepped on its gradient alone."""
    results = run_ranks(3, NO_GRAD.replace("@OPT@", opt), tmp_path, timeout=120)
    assert results[0] == {"server": True}
    for r in results[1:]:
        for name, diff in r["diff"].items():
            assert diff < 1e-6, (name, r["diff"])
        assert r["frozen_moved"] == 0.0
        assert r["moved"]["mine.weight"] > 1e-3 and r["moved"]["rare.weight"] > 1e-3
        # worker 0 also sent the initial parameters; nothing else but the gradients that exist
        assert r["bytes_sent"] == r["expected_sent"], r


SPARSE = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()

def build():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(20, 4, sparse=True), "head": torch.nn.Linear(4, 3)})

def loss(m, worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    idx, y = torch.randint(0, 20, (6,), generator=g), torch.randn(6, 3, generator=g)
    return torch.nn.functional.mse_loss(m["head"](m["emb"](idx)), y)

model, ref = build(), build()
try:
    ps.DistributedOptimizer(torch.optim.SparseAdam(list(model["emb"].parameters())),
                            named_parameters=model["emb"].named_parameters(), sync="bsp")
    sparse_adam = None
except ValueError as e:
    sparse_adam = str(e)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                              named_parameters=model.named_parameters(), sync="bsp")
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
for step in range(5):
    opt.zero_grad(); loss(model, k, step).backward()
    assert model["emb"].weight.grad.is_sparse
    opt.step()
    grads = []
    for j in range(W):
        ref.zero_grad(); loss(ref, j, step).backward()
        grads.append([p.grad.to_dense() for p in ref.parameters()])   # Horovod's sparse_as_dense
    for i, p in enumerate(ref.parameters()):
        p.grad = sum(g[i] for g in grads) / W
    ref_opt.step()
ps.shutdown()
report({"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        "sparse_adam": sparse_adam})
'''


def test_sparse_gradients_travel_dense(tmp_path):
    results = run_ranks(3, SPARSE, tmp_path, timeout=120)
    for r in results[1:]:
        assert r["diff"] < 1e-6, r
        assert "SparseAdam" in r["sparse_adam"] and r["sparse_adam"].startswith("optimizer:"), r


FLOAT64 = r'''
import atexit, numpy as np, torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()
KIND = "@KIND@"

def compressor():
    if KIND == "nm":
        return hvd.Compression.nm(2, 4, shared_mask=False)
    return hvd.Compression.cluster(k=4, sample=64, seed=3)

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)).double()

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return (torch.randn(6, 8, generator=g, dtype=torch.float64),
            torch.randn(6, 4, generator=g, dtype=torch.float64))

residual = {}

def nm_reference(j, name, g):
    # numpy: the float64 gradient as float32, plus the float32 residual; the 2 largest magnitudes of every 4
    x = g.numpy().astype(np.float32).reshape(-1) + residual.get((j, name), np.zeros(g.numel(), np.float32))
    groups = x.reshape(-1, 4)
    top = np.argsort(-np.abs(groups), axis=1, kind="stable")[:, :2]
    kept = np.zeros_like(groups)
    np.put_along_axis(kept, top, np.take_along_axis(groups, top, axis=1), axis=1)
    residual[(j, name)] = x - kept.reshape(-1)
    return torch.from_numpy(kept.reshape(g.shape).astype(np.float64))

codecs = [compressor() for _ in range(W)]  # cluster: each worker's own codec, in its push order

def reference(j, name, g):
    if KIND == "nm":
        return nm_reference(j, name, g)
    payload, ctx = codecs[j].compress(g, name=name)
    return codecs[j].decompress(payload, ctx)

model, ref = build(), build()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp", compression=compressor())
shard = opt._shards[0]
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for step in range(5):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    named = dict(ref.named_parameters())
    grads = []
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        grads.append({n: reference(j, n, named[n].grad.clone()) for n in shard})
    for n, p in named.items():
        p.grad = sum(g[n] for g in grads) / W
    ref_opt.step()
s = ps.stats()
ps.shutdown()
report({"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}), "bytes_sent": s["bytes_sent"],
        "dense": sum(p.numel() * 8 for p in model.parameters())})
'''


@pytest.mark.parametrize("kind", ["nm", "cluster"])
def test_float64_models_train_with_nm_and_cluster_compression(tmp_path, kind):
    results = run_ranks(3, FLOAT64.replace("@KIND@", kind), tmp_path, timeout=120)
    for r in results[1:]:
        assert r["dtypes"] == ["torch.float64"]
        assert r["diff"] < 1e-12, r
    # worker 1 sent only its compressed gradients: fewer bytes than 5 dense float64 pushes
    assert results[2]["bytes_sent"] < 5 * results[2]["dense"]
