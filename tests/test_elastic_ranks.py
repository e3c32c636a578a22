"""hvd.elastic under a fixed mpiexec world: Horovod's elastic training scripts run unchanged,
state syncs from rank 0, commits restore exactly, and ElasticSampler partitions like Horovod's."""
import math
import random

import pytest
import torch

from conftest import run_ranks

# Modelled on Horovod's examples/elastic/pytorch scripts; only the import differs.
ELASTIC_TRAINING = r'''
import torch
import torch.nn.functional as F
import torch.utils.data
import horovod.torch as hvd

hvd.init()
N, BATCH, EPOCHS, COMMIT_EVERY, LR = 48, 4, 3, 2, 0.05
torch.manual_seed(100 + hvd.rank())           # different init per rank: the sync must fix it
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
g = torch.Generator().manual_seed(5)
X, Y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
dataset = torch.utils.data.TensorDataset(torch.arange(N), X, Y)
train_sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=11)
train_loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=train_sampler)

optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

trained = []                                  # (epoch, this rank's sample indices) per step
interrupted = []


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        state.model.train()
        for state.batch, (idx, data, target) in enumerate(train_loader):
            state.optimizer.zero_grad()
            loss = F.cross_entropy(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            trained.append((state.epoch, idx.tolist()))
            state.train_sampler.record_batch(state.batch, BATCH)
            if state.batch % COMMIT_EVERY == 0:
                state.commit()
            if state.epoch == 1 and state.batch == 2 and not interrupted:
                interrupted.append(True)      # every rank at once: reset, sync, carry on
                raise hvd.elastic.HostsUpdatedInterrupt(False)
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        state.commit()
    return "done"


resets = []


def on_state_reset():
    resets.append(hvd.size())
    for param_group in optimizer.param_groups:
        param_group['lr'] = LR * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler,
                               epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])
result = train(state)
report({"result": result, "resets": resets, "trained": trained, "epoch": state.epoch,
        "batch": state.batch, "sampler_epoch": state.train_sampler.epoch,
        "params": {n: p.detach().tolist() for n, p in model.named_parameters()}})
'''.replace("import horovod.torch as hvd", "import fusionring.torch as hvd")


def horovod_epoch_order(n, seed, epoch):
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def horovod_partition(order, world):
    """Horovod's rule: pad with the first indices to a multiple of world, rank r every world-th."""
    per_rank = math.ceil(len(order) / world)
    padded = order + order[:per_rank * world - len(order)]
    return [padded[r::world] for r in range(world)]


def reference_training(world, trained):
    """Single-process training on the same global batches: the mean of each rank's loss."""
    torch.manual_seed(100)                    # rank 0's initial weights
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(5)
    X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * world, momentum=0.9)
    for step in range(len(trained[0])):
        optimizer.zero_grad()
        losses = [torch.nn.functional.cross_entropy(model(X[trained[r][step][1]]),
                                                    Y[trained[r][step][1]])
                  for r in range(world)]
        (sum(losses) / world).backward()
        optimizer.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("np_", [2, 3])
def test_horovod_elastic_script_matches_single_process_training(np_, tmp_path):
    results = run_ranks(np_, ELASTIC_TRAINING, tmp_path, timeout=60)
    trained = [r["trained"] for r in results]
    for out in results:
        assert out["result"] == "done"
        assert out["resets"] == [np_]         # the interrupt ran the reset callbacks once
        assert (out["epoch"], out["batch"], out["sampler_epoch"]) == (2, 0, 3)
    # Every rank trained on its share of Horovod's partition, epoch by epoch, through the
    # interrupt (which re-partitioned the samples not processed yet).
    for epoch in range(3):
        expected = horovod_partition(horovod_epoch_order(48, 11, epoch), np_)
        for r in range(np_):
            got = [i for e, batch in trained[r] if e == epoch for i in batch]
            assert got == expected[r], (epoch, r)
    reference = reference_training(np_, trained)
    for name, want in reference.items():
        ranks = [torch.tensor(out["params"][name]) for out in results]
        for r, value in enumerate(ranks):
            assert torch.equal(value, ranks[0]), f"rank {r} differs on {name}"
        assert torch.allclose(ranks[0], want.detach(), atol=2e-5, rtol=1e-4), name


STATE = r'''
import copy
import torch
import fusionring.torch as hvd

hvd.init()
r, P = hvd.rank(), hvd.size()
out = {}
torch.manual_seed(r)                                   # every rank starts different
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
model(torch.randn(5, 3)).sum().backward()              # local momentum buffers, rank-specific
optimizer.step()
sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=3)
sampler.set_epoch(r)
state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=10 + r, batch=r,
                               history=[r])


def snapshot():
    return {"model": {k: v.tolist() for k, v in model.state_dict().items()},
            "momentum": [optimizer.state[p]["momentum_buffer"].tolist()
                         for p in model.parameters()],
            "lr": optimizer.param_groups[0]["lr"],
            "epoch": state.epoch, "batch": state.batch, "history": list(state.history),
            "sampler": [sampler.epoch, sorted(sampler.processed_indices),
                        list(sampler.remaining_indices)],
            "is_same": [state.model is model, state.optimizer is optimizer,
                        state.train_sampler is sampler]}


@hvd.elastic.run
def look(state, tag, extra=None):
    out[tag] = snapshot()
    out[tag + " extra"] = extra
    return tag


out["returned"] = look(state, "synced", extra=5)


def scribble():
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.5)
    model.train()
    optimizer.zero_grad()
    model(torch.randn(5, 3) + r).sum().backward()      # changes BatchNorm stats too
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 7.0
    state.epoch += 5
    state.batch = 99
    state.history.append(99)
    state.train_sampler.record_batch(0, 2)
    state.train_sampler.reset()


# save/restore: changes after a commit are undone exactly, and again after more changes
with torch.no_grad():
    model[0].weight.mul_(2)
state.epoch = 20
state.history.append(20)
state.commit()
committed = snapshot()
for attempt in range(2):
    scribble()
    out["changed %d" % attempt] = snapshot() != committed
    state.restore()
    out["restored %d" % attempt] = snapshot() == committed

# a failure inside run: the state goes back to the last commit and the error says why
@hvd.elastic.run
def failing(state):
    scribble()
    raise hvd.HorovodInternalError("rank 1 lost its connection")


try:
    failing(state)
    out["error"] = None
except hvd.HorovodInternalError as exc:
    out["error"] = [type(exc).__name__, str(exc), type(exc.__cause__).__name__]
out["after error"] = snapshot() == committed

# a real collective failure (ranks disagree on a shape) takes the same path
@hvd.elastic.run
def mismatched(state):
    scribble()
    hvd.allreduce(torch.zeros(3 + (r == 1)), name="elastic.mismatch")


try:
    mismatched(state)
    out["mismatch"] = None
except hvd.TensorMismatchError as exc:
    out["mismatch"] = str(exc)
out["after mismatch"] = snapshot() == committed
out["host updates"] = state.check_host_updates()
out["usable"] = hvd.allreduce(torch.ones(2), name="elastic.after", op=hvd.Sum).tolist()
report(out)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_state_sync_commit_restore_and_failures(np_, tmp_path):
    results = run_ranks(np_, STATE, tmp_path, timeout=60)
    root = results[0]["synced"]
    assert root["epoch"] == 10 and root["batch"] == 0 and root["history"] == [0]
    assert root["lr"] == pytest.approx(0.1) and root["sampler"][0] == 0
    for r, out in enumerate(results):
        assert out["returned"] == "synced" and out["synced extra"] == 5
        assert out["synced"] == root, f"rank {r} did not take rank 0's state"
        assert out["synced"]["is_same"] == [True, True, True]
        for attempt in range(2):
            assert out["changed %d" % attempt] and out["restored %d" % attempt], (r, attempt)
        kind, message, cause = out["error"]
        assert kind == "FusionRingError" and cause == "FusionRingError"
        assert "rank 1 lost its connection" in message
        assert "restored to its last commit" in message
        assert "launcher that can replace ranks" in message and "fixed" in message
        assert out["after error"]
        assert "elastic.mismatch" in out["mismatch"]
        assert "launcher that can replace ranks" in out["mismatch"]
        assert out["after mismatch"]
        assert out["host updates"] is None
        assert out["usable"] == [float(np_)] * 2


SAMPLER = r'''
import torch
import fusionring.torch as hvd

hvd.init()
r, P = hvd.rank(), hvd.size()
N, SEED = 23, 5
out = {}
s = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=SEED)
out["epoch0"] = list(s)
out["len"] = len(s)
out["batch1"] = s.get_indices(1, 3)
s.record_batch(0, 3)
s.record_batch(1, 3)
s.reset()
out["remaining"] = list(s.remaining_indices)
out["after reset"] = list(s)
out["len after reset"] = len(s)
saved = s.state_dict()
s.set_epoch(1)
out["epoch1"] = list(s)
out["processed after set_epoch"] = sorted(s.processed_indices)

t = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=SEED)
t.load_state_dict(saved)
out["round trip"] = [t.state_dict() == saved, list(t) == out["after reset"]]
t.load_state_dict({"epoch": 0, "processed_num": 6 * P})   # Horovod's newer form
out["processed_num form"] = list(t) == out["after reset"]

# record_indices: each rank records its own samples; a commit shares them with every rank
u = hvd.elastic.ElasticSampler(list(range(N)), shuffle=False)
state = hvd.elastic.TorchState(sampler=u)
u.record_indices(u.get_indices(0, 2))
state.commit()
u.reset()
out["shared"] = sorted(u.processed_indices)
out["unshuffled remaining"] = list(u.remaining_indices)
out["unshuffled"] = list(u)
report(out)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_elastic_sampler_partitions_like_horovod(np_, tmp_path):
    results = run_ranks(np_, SAMPLER, tmp_path, timeout=60)
    n, seed = 23, 5
    per_rank = math.ceil(n / np_)
    order0, order1 = horovod_epoch_order(n, seed, 0), horovod_epoch_order(n, seed, 1)
    epoch0 = [out["epoch0"] for out in results]
    # one epoch: disjoint shares covering the dataset, padded with the order's first indices
    assert all(len(share) == per_rank == out["len"] for share, out in zip(epoch0, results))
    everything = sorted(i for share in epoch0 for i in share)
    assert everything == sorted(list(range(n)) + order0[:per_rank * np_ - n])
    assert epoch0 == horovod_partition(order0, np_)
    processed = set(order0[:6 * np_])          # two batches of 3 on every rank
    remaining = [i for i in order0 if i not in processed]
    after = [out["after reset"] for out in results]
    assert after == horovod_partition(remaining, np_)
    for r, out in enumerate(results):
        assert out["batch1"] == epoch0[r][3:6]
        assert out["remaining"] == remaining
        assert out["len after reset"] == math.ceil(len(remaining) / np_)
        assert out["processed after set_epoch"] == []
        assert out["round trip"] == [True, True] and out["processed_num form"]
        assert out["shared"] == list(range(2 * np_))
        assert out["unshuffled remaining"] == list(range(2 * np_, n))
        assert out["unshuffled"] == horovod_partition(list(range(2 * np_, n)), np_)[r]
    # set_epoch reshuffles deterministically: the same new order on every rank
    epoch1 = [out["epoch1"] for out in results]
    assert epoch1 == horovod_partition(order1, np_) and epoch1 != epoch0
