"""Horovod 0.28.1 behaviours of the object and optimizer-state helpers and of synchronize():
broadcast_optimizer_state's `model` argument, cloudpickle serialization (lambdas, closures,
local classes), a serialization failure reported on every rank, and synchronize() of a
finished or unknown handle."""
import inspect

import torch

from conftest import run_ranks


def _trained(seed: int):
    """A model with a sparse embedding and an SGD optimizer with momentum state, from `seed`."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * seed, momentum=0.9)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    return model, opt


OPTIMIZER_STATE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
exec(TRAINED)
out = {}


def grads(model):
    return [None if p.grad is None else [p.grad.is_sparse, float(p.grad.to_dense().abs().sum())]
            for p in model.parameters()]


# Horovod's signature: broadcast_optimizer_state(optimizer, root_rank, model=None).
for how in ("keyword", "positional", "none"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    try:
        if how == "keyword":
            hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
        elif how == "positional":
            hvd.broadcast_optimizer_state(opt, 0, model)
        else:
            hvd.broadcast_optimizer_state(opt, 0)
        out[how] = {"lr": opt.param_groups[0]["lr"], "grads": grads(model)}
    except Exception as exc:
        out[how] = repr(exc)

# A trained optimizer: every rank ends with root's momentum and learning rate.
model, opt = _trained(r + 1)
hvd.broadcast_optimizer_state(opt, root_rank=1, model=model)
state = opt.state_dict()
out["trained"] = {"lr": state["param_groups"][0]["lr"],
                  "momentum": [state["state"][i]["momentum_buffer"].to_dense().tolist()
                               for i in range(3)]}

# SparseAdam needs sparse gradients: a fresh one's zero gradients stay sparse, so the
# gradients of the next backward accumulate into them and its step works.
torch.manual_seed(0)
emb = torch.nn.Embedding(10, 3, sparse=True)
sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
hvd.broadcast_optimizer_state(sparse_opt, root_rank=0)
emb(torch.tensor([1, 4])).sum().backward()
try:
    sparse_opt.step()
    out["sparse adam"] = [emb.weight.grad.is_sparse, emb.weight.detach().sum().item()]
except Exception as exc:
    out["sparse adam"] = repr(exc)

try:
    hvd.broadcast_optimizer_state(opt, 0, hvd.global_process_set)
    out["not a model"] = None
except TypeError as exc:
    out["not a model"] = str(exc)
out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
report(out)
'''


def test_broadcast_optimizer_state_takes_horovods_model_argument(tmp_path):
    code = OPTIMIZER_STATE.replace(
        "exec(TRAINED)", f"exec({inspect.getsource(_trained)!r})")
    results = run_ranks(2, code, tmp_path, timeout=60)
    # Horovod: the fresh optimizer's zero gradients are sparse on the parameters of the
    # model's sparse embeddings (SGD), dense elsewhere; without a model all are dense.
    for how in ("keyword", "positional"):
        for got in results:
            assert got[how] == {"lr": 0.1, "grads": [[True, 0.0], [False, 0.0], [False, 0.0]]}, \
                (how, got[how])
    for got in results:
        assert got["none"] == {"lr": 0.1, "grads": [[False, 0.0]] * 3}, got["none"]
    _, root_opt = _trained(2)
    root = root_opt.state_dict()
    for got in results:
        assert got["trained"]["lr"] == root["param_groups"][0]["lr"]
        for value, want in zip(got["trained"]["momentum"],
                               (root["state"][i]["momentum_buffer"].to_dense() for i in range(3))):
            assert torch.equal(torch.tensor(value), want)
    # The reference SparseAdam step: from zero state, Adam's first step moves each touched
    # entry by lr (the sign of its gradient, here +1), the others not at all.
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    expected = emb.weight.detach().sum().item() - 0.1 * 2 * 3
    for got in results:
        assert isinstance(got["sparse adam"], list), got["sparse adam"]
        assert got["sparse adam"][0] is True
        assert abs(got["sparse adam"][1] - expected) < 1e-4
        assert "model" in got["not a model"] and "process_set" in got["not a model"]
        assert got["after"] == 2.0


OBJECTS = r'''
import threading
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}


def make_adder(k):
    def add(x):
        return x + k
    return add


class Local:
    def __init__(self, v):
        self.v = v

    def twice(self):
        return 2 * self.v


# Lambdas, closures and classes defined in the script travel (cloudpickle, as Horovod).
fn = (lambda x: x * 10 + 1) if r == 0 else None
out["lambda"] = hvd.broadcast_object(fn, root_rank=0)(4)
out["closure"] = hvd.broadcast_object(make_adder(100 + r) if r == 1 else None, root_rank=1)(5)
out["local class"] = hvd.broadcast_object(Local(7 + r), root_rank=0).twice()
out["gathered"] = [f() for f in hvd.allgather_object(lambda: 10 * r + 3)]
out["gathered objects"] = [o.twice() for o in hvd.allgather_object(Local(r))]

# Root cannot serialize its object: every rank raises, none waits, and the library goes on.
for attempt in range(2):
    try:
        hvd.broadcast_object(threading.Lock() if r == 0 else None, root_rank=0)
        out["failure %d" % attempt] = None
    except Exception as exc:
        out["failure %d" % attempt] = [type(exc).__name__, str(exc)]
    out["next %d" % attempt] = hvd.broadcast_object({"k": r}, root_rank=0)
# One rank cannot serialize its part of an allgather: every rank raises, naming it.
try:
    hvd.allgather_object([threading.Lock()] if r == 1 else [r])  # one name: both are lists
    out["gather failure"] = None
except Exception as exc:
    out["gather failure"] = [type(exc).__name__, str(exc)]
out["gather after"] = hvd.allgather_object(("x", r))
out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
report(out)
'''


def test_objects_travel_with_cloudpickle_and_failures_reach_every_rank(tmp_path):
    results = run_ranks(2, OBJECTS, tmp_path, timeout=60,
                        env={"FUSIONRING_STALL_SHUTDOWN_S": "20"})
    for r, got in enumerate(results):
        assert got["lambda"] == 41
        assert got["closure"] == 106
        assert got["local class"] == 14
        assert got["gathered"] == [3, 13]
        assert got["gathered objects"] == [0, 2]
        for attempt in range(2):
            kind, message = got["failure %d" % attempt]
            if r != 0:
                assert "rank 0" in message and "lock" in message, message
            assert "pickle" in message.lower(), message
            assert got["next %d" % attempt] == {"k": 0}
        kind, message = got["gather failure"]
        if r != 1:
            assert "rank 1" in message and "list" in message, message
        assert "pickle" in message.lower(), message
        assert got["gather after"] == [["x", 0], ["x", 1]]
        assert got["after"] == 2.0


SYNCHRONIZE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
out = {}
h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="s")
out["first"] = hvd.synchronize(h).tolist()
out["again"] = repr(hvd.synchronize(h))
out["unknown"] = repr(hvd.synchronize(123456))
out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
report(out)
'''


def test_synchronize_of_a_finished_or_unknown_handle_returns_none(tmp_path):
    # Horovod's synchronize() returns None for a handle it does not hold (mpi_ops.py).
    for got in run_ranks(2, SYNCHRONIZE, tmp_path, timeout=60):
        assert got == {"first": [2.0, 2.0], "again": "None", "unknown": "None", "after": 2.0}


SETS_AND_GROUPS = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
low = hvd.add_process_set([0, 1])
out = {}
# An unnamed broadcast_object within a set that rank 2 is not in, then global ones: each set
# numbers its own unnamed calls, as Horovod's per-set negotiation does.
if r in (0, 1):
    out["in set"] = hvd.broadcast_object({"from": r}, root_rank=0, process_set=low)
out["global"] = hvd.broadcast_object({"from": r}, root_rank=0)
out["global again"] = hvd.broadcast_object([r], root_rank=2)

# broadcast_optimizer_state on the optimizer inside a DistributedOptimizer: the wrapper (and
# a scheduler on it) keeps seeing the groups that step.
model = torch.nn.Linear(4, 1)
base = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(base, root_rank=0)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
lrs = []
for step in range(3):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched.step()
    lrs.append([base.param_groups[0]["lr"], opt.param_groups[0]["lr"]])
out["lrs"] = lrs
out["same groups"] = opt.param_groups is base.param_groups and opt.state is base.state
out["weights"] = model.weight.detach().tolist()
report(out)
'''


def test_unnamed_object_broadcasts_count_per_process_set_and_broadcast_optimizer_state_keeps_groups(tmp_path):
    results = run_ranks(3, SETS_AND_GROUPS, tmp_path, timeout=60,
                        env={"FUSIONRING_STALL_SHUTDOWN_S": "20"})
    for r, out in enumerate(results):
        if r < 2:
            assert out["in set"] == {"from": 0}
        assert out["global"] == {"from": 0} and out["global again"] == [2]
        assert out["lrs"] == [[0.05, 0.05], [0.025, 0.025], [0.0125, 0.0125]]
        assert out["same groups"] is True
        assert out["weights"] == results[0]["weights"]
