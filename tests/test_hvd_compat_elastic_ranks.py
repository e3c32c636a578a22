"""hvd.elastic as in Horovod 0.28.1: ObjectState.sync() broadcasts the last committed values,
State.on_hosts_updated() makes the next commit raise HostsUpdatedInterrupt on every rank (rank
0's messages decide), and ElasticSampler's state_dict is Horovod's {epoch, processed_num}."""
import math
import random

import pytest

from conftest import run_ranks

OBJECT_STATE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
out = {}
st = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=0, history=[0])
st.epoch = 5 + r                      # not committed: dropped by sync on every rank
st.history.append(r)
st.sync()
out["fresh"] = [st.epoch, st.history]
st.epoch = 10 + r
st.commit()
st.epoch = 20 + r
st.sync()                             # rank 0's committed value
out["committed"] = st.epoch
st.epoch = 30
st.restore()                          # back to what sync installed
out["restored"] = st.epoch

# TorchState's plain attributes behave alike; its model is synced from rank 0's weights.
torch.manual_seed(r)
model = torch.nn.Linear(2, 1)
ts = hvd.elastic.TorchState(model, None, batch=0)
ts.batch = 7 + r
ts.sync()
out["torch state"] = [ts.batch, model.weight.detach().tolist()]


@hvd.elastic.run
def train(state):
    return state.batch


ts.batch = 3
out["run"] = train(ts)
report(out)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_object_state_sync_broadcasts_the_committed_state(np_, tmp_path):
    import torch

    torch.manual_seed(0)
    root_weight = torch.nn.Linear(2, 1).weight.detach().tolist()
    for got in run_ranks(np_, OBJECT_STATE, tmp_path, timeout=60):
        assert got["fresh"] == [0, [0]]
        assert got["committed"] == 10
        assert got["restored"] == 10
        assert got["torch state"] == [0, root_weight]
        assert got["run"] == 0


HOST_UPDATES = r'''
import fusionring.torch as hvd
from fusionring.common.elastic import HostUpdateResult
from fusionring.common.exceptions import HostsUpdatedInterrupt
hvd.init()
r = hvd.rank()
out = {}
st = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, x=1)


def commit(tag):
    try:
        st.commit()
        out[tag] = None
    except HostsUpdatedInterrupt as exc:
        out[tag] = exc.skip_sync


commit("nothing")
if r == 0:
    st.on_hosts_updated(5, HostUpdateResult.removed)
commit("removed on rank 0")
commit("again")
if r == 1:
    st.on_hosts_updated(9, HostUpdateResult.added)
commit("on rank 1 only")
if r == 0:
    st.on_hosts_updated(7, HostUpdateResult.added)
    st.on_hosts_updated(8, HostUpdateResult.removed)
    st.on_hosts_updated(3, HostUpdateResult.added)  # older than the last seen: ignored
commit("mixed")
if r == 0:
    st.on_hosts_updated(20, HostUpdateResult.added)
st.on_reset()                         # drops messages not yet acted on
commit("after reset")

# Inside hvd.elastic.run: the interrupt resets the state and calls the function again.
calls, resets = [], []
st.register_reset_callbacks([lambda: resets.append(True)])


@hvd.elastic.run
def train(state):
    calls.append(state.x)
    state.x += 1
    if len(calls) == 1 and r == 0:
        state.on_hosts_updated(30, HostUpdateResult.added)
    state.commit()
    return len(calls)


out["run"] = [train(st), calls, len(resets)]
report(out)
'''


def test_on_hosts_updated_interrupts_every_rank_at_the_next_commit(tmp_path):
    # Expected values as Horovod 0.28.1 gives them for the same script.
    for got in run_ranks(2, HOST_UPDATES, tmp_path, timeout=60):
        assert got["nothing"] is None
        assert got["removed on rank 0"] is True      # only removals: skip the sync
        assert got["again"] is None
        assert got["on rank 1 only"] is None         # rank 0's messages decide
        assert got["mixed"] is False
        assert got["after reset"] is None
        # x=1 synced, then x=2 committed before the interrupt; the second call syncs x=2
        assert got["run"] == [2, [1, 2], 1]


def horovod_sampler(n, world, seed, epoch, processed_num):
    """Horovod's ElasticSampler: the epoch's order from processed_num on, padded, strided."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    remaining = order[processed_num:]
    per_rank = math.ceil(len(remaining) / world)
    padded = remaining + remaining[:per_rank * world - len(remaining)]
    return [padded[r:per_rank * world:world] for r in range(world)]


SAMPLER = r'''
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
N, SEED, BATCH = 24, 7, 2
out = {}
s = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=SEED)
s.set_epoch(1)
out["start"] = [s.state_dict(), s.processed_num]
s.record_batch(0, BATCH)
s.record_batch(1, BATCH)
out["after two batches"] = [s.state_dict(), s.processed_num]
s.reset()
out["partition"] = list(s)

t = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=SEED)
t.load_state_dict({"epoch": 1, "processed_num": 2 * BATCH * P})     # Horovod's form
out["horovod form"] = [t.processed_num, list(t)]
t.load_state_dict({"epoch": 1, "processed_indices": set(s.processed_indices)})  # older form
out["indices form"] = [t.state_dict(), list(t)]

# record_indices marks samples out of order: the dict keeps them, and round-trips.
u = hvd.elastic.ElasticSampler(list(range(N)), shuffle=False)
u.record_indices([5, 1] if r == 0 else [9])
u._share_recorded_indices()
saved = u.state_dict()
v = hvd.elastic.ElasticSampler(list(range(N)), shuffle=False)
v.load_state_dict(saved)
out["out of order"] = [saved["processed_num"], sorted(saved.get("processed_indices", [])),
                       sorted(v.processed_indices), list(v) == list(u.reset() or u)]
report(out)
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_elastic_sampler_state_dict_is_horovods(np_, tmp_path):
    n, seed, batch = 24, 7, 2
    results = run_ranks(np_, SAMPLER, tmp_path, timeout=60)
    done = 2 * batch * np_
    reference = horovod_sampler(n, np_, seed, 1, done)
    for r, got in enumerate(results):
        assert got["start"] == [{"epoch": 1, "processed_num": 0}, 0]
        assert got["after two batches"] == [{"epoch": 1, "processed_num": done}, done]
        assert got["partition"] == reference[r]
        assert got["horovod form"] == [done, reference[r]]
        assert got["indices form"] == [{"epoch": 1, "processed_num": done}, reference[r]]
        count, indices, loaded, same = got["out of order"]
        assert count == 3 and indices == [1, 5, 9] and loaded == [1, 5, 9] and same


RECORD_AFTER_RESTORE = r'''
import fusionring.torch as hvd
hvd.init()
P = hvd.size()
N, BATCH = 8 * P, 2
s = hvd.elastic.ElasticSampler(list(range(N)), shuffle=True, seed=3)
state = hvd.elastic.TorchState(sampler=s)
state.sync()
s.set_epoch(2)
s.record_batch(0, BATCH)
s.record_batch(1, BATCH)
state.commit()
s.record_batch(2, BATCH)
s.record_batch(3, BATCH)
counts = [s.processed_num]
state.restore()
counts.append(s.processed_num)
s.record_batch(2, BATCH)       # the loader's count goes on; the sampler marks the next batch
counts.append(s.processed_num)
state.commit()
state.sync()
counts.append(s.processed_num)
report({"counts": counts, "len": len(s), "mine": list(s)})
'''


@pytest.mark.parametrize("np_", [1, 2])
def test_record_batch_counts_batches_as_horovod_does_whatever_their_index(np_, tmp_path):
    """Horovod's record_batch adds batch_size * size() to processed_num and ignores batch_idx
    (a data loader's count that goes on after a restore must not skip or lose samples)."""
    results = run_ranks(np_, RECORD_AFTER_RESTORE, tmp_path, timeout=60)
    step = 2 * np_
    reference = horovod_sampler(8 * np_, np_, 3, 2, 3 * step)
    for r, got in enumerate(results):
        assert got["counts"] == [4 * step, 2 * step, 3 * step, 3 * step]
        assert got["len"] == len(reference[r]) and got["mine"] == reference[r]
