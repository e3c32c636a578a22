"""Bursts (a backward pass's gradients negotiated in one round) and the negotiation's AND
through the shared-memory window."""
import pytest

from conftest import run_ranks


def _no_failures(results):
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"

WINDOW_AND = r'''
import numpy as np, torch
from mpi4py import MPI
from fusionring import _C
from fusionring.dtypes import DTYPE_CODES

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 4096)

def words(r, count, step):
    g = np.random.default_rng(1000 * step + 10 * r + count)
    # Mostly ones, so the AND of a few ranks still has bits set to compare.
    return g.integers(0, 2**63, count, dtype=np.uint64) | g.integers(0, 2**63, count, dtype=np.uint64) \
        | np.uint64(1 << 63)

failures = []
# ANDs and sums alternate on the same window's halves: a slow reader must not see a
# later operation's data.
for step, count in enumerate([1, 7, 300, 512, 3, 64]):
    mine = words(rank, count, step)
    expected = np.bitwise_and.reduce([words(r, count, step) for r in range(size)])
    shm.band_allreduce(mine.ctypes.data, count)
    if not np.array_equal(mine, expected):
        failures.append(f"AND of {count} words")
    x = torch.full((1000,), float(rank + step))
    shm.allreduce([x.data_ptr()], [x.numel() * 4], DTYPE_CODES[torch.float32], 0)
    if not torch.all(x == sum(float(r + step) for r in range(size))):
        failures.append(f"sum after the AND of {count} words")
too_many = np.zeros(513, dtype=np.uint64)
try:
    shm.band_allreduce(too_many.ctypes.data, too_many.size)
    failures.append("513 words in a 4096-byte slot were accepted")
except ValueError as exc:
    if "513 words" not in str(exc):
        failures.append(f"unclear error: {exc}")
report(failures)
'''


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_and_through_the_window_matches_numpy(np_, tmp_path):
    _no_failures(run_ranks(np_, WINDOW_AND, tmp_path, timeout=120))


ONE_ROUND_PER_STEP = r'''
import torch, torch.nn as nn, torch.nn.functional as F
import fusionring.torch as hvd
hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(hvd.rank())
x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
def step():
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(3):
    step()
before = hvd.communication_stats()
steps = 20
for _ in range(steps):
    step()
after = hvd.communication_stats()
report({"batches": after["allreduce_batches"] - before["allreduce_batches"],
        "tensors": after["allreduce_tensors"] - before["allreduce_tensors"],
        "cycles": after["cycles"] - before["cycles"], "steps": steps})
'''


@pytest.mark.parametrize("shared_memory", ["auto", "off"])
def test_a_backward_pass_is_negotiated_in_one_round_and_reduced_in_one_batch(shared_memory,
                                                                             tmp_path):
    # A long cycle time makes the burst window (five cycles) far longer than a backward pass
    # here, however loaded the machine: every step's six gradients must go together.
    results = run_ranks(2, ONE_ROUND_PER_STEP, tmp_path, timeout=120,
                        env={"FUSIONRING_CYCLE_TIME_MS": "100", "FUSIONRING_BURSTS": "on",
                             "FUSIONRING_SHARED_MEMORY": shared_memory})
    for result in results:
        assert result["tensors"] == 6 * result["steps"]
        assert result["batches"] == result["steps"], result
        assert result["cycles"] <= result["steps"] + 2, result


HELD_UNTIL = r'''
import time, torch
import fusionring.torch as hvd
from fusionring import state as _rt
hvd.init()
rt = _rt.get()
out = {}
hvd.allreduce(torch.zeros(1), name="warm")
# Held: nothing ends the burst, so it waits out its window (five cycles of 200 ms).
with _rt.burst():
    h = hvd.allreduce_async(torch.ones(4), name="held")
t0 = time.monotonic()
time.sleep(0.3)
out["done_early"] = hvd.poll(h)
hvd.synchronize(h)
hvd.allreduce(torch.zeros(1), name="between.1")
# Ended by the submitter: negotiated at once.
with _rt.burst():
    h = hvd.allreduce_async(torch.ones(4), name="ended")
rt.end_burst()
t0 = time.monotonic()
while not hvd.poll(h):
    time.sleep(0.001)
out["ended_s"] = time.monotonic() - t0
hvd.synchronize(h)
hvd.allreduce(torch.zeros(1), name="between.2")
# Ended by a caller that waits for it.
with _rt.burst():
    h = hvd.allreduce_async(torch.ones(4), name="waited", op=hvd.Sum)
t0 = time.monotonic()
result = hvd.synchronize(h)
out["waited_s"] = time.monotonic() - t0
out["sum_ok"] = bool(torch.all(result == hvd.size()))
report(out)
'''


def test_a_burst_is_held_until_it_ends_a_caller_waits_or_its_window_passes(tmp_path):
    results = run_ranks(2, HELD_UNTIL, tmp_path, timeout=120,
                        env={"FUSIONRING_CYCLE_TIME_MS": "200", "FUSIONRING_BURSTS": "on"})
    for result in results:
        assert result["done_early"] is False, result
        assert result["ended_s"] < 0.6, result  # the window is 1 s
        assert result["waited_s"] < 0.6, result
        assert result["sum_ok"]


def test_bursts_off_start_a_round_at_once(tmp_path):
    code = HELD_UNTIL.split("out = {}")[0] + r'''
with _rt.burst():
    h = hvd.allreduce_async(torch.ones(4), name="unheld", op=hvd.Sum)
t0 = time.monotonic()
while not hvd.poll(h):
    time.sleep(0.001)
report({"s": time.monotonic() - t0, "sum_ok": bool(torch.all(hvd.synchronize(h) == 2))})
'''
    results = run_ranks(2, code, tmp_path, timeout=120,
                        env={"FUSIONRING_CYCLE_TIME_MS": "200", "FUSIONRING_BURSTS": "off"})
    for result in results:
        assert result["s"] < 0.6 and result["sum_ok"], result  # a held burst waits 1 s


WINDOW_ROUND = r'''
import numpy as np, torch
from mpi4py import MPI
from fusionring import _C
from fusionring.dtypes import DTYPE_CODES

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
shm = _C.SharedMemoryAllreduce(MPI._handleof(comm.Dup()), 1 << 16)
F32, F64 = DTYPE_CODES[torch.float32], DTYPE_CODES[torch.float64]

def data(r, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 * step + r)
    return [torch.randn(n, generator=g).to(dtype) for n in (5, 1000, 3)]

def offer(words, tensors, code, op=0, pre=1.0, post=1.0):
    return shm.band_then_allreduce(words.ctypes.data, words.size, [t.data_ptr() for t in tensors],
                                   [t.numel() * t.element_size() for t in tensors], code, op,
                                   pre, post)

failures = []
def check(cond, what):
    if not cond:
        failures.append(what)

# 1. Identical words everywhere: the AND and the reduction in one wait, True everywhere.
for step in range(3):
    w = np.array([7, 2**63 + 5, step], dtype=np.uint64)
    mine = data(rank, step)
    done = offer(w, mine, F32)
    check(done is True, f"step {step}: identical words not reduced")
    check(np.array_equal(w, [7, 2**63 + 5, step]), f"step {step}: AND of identical words changed")
    want = [sum(data(r, step)[i].double() for r in range(size)) for i in range(3)]
    check(all(torch.allclose(m.double(), x, rtol=1e-6, atol=1e-5) for m, x in zip(mine, want)),
          f"step {step}: sum differs from numpy")
# 2. Words that differ on one rank: only the AND, False everywhere, data untouched.
w = np.array([2**64 - 1, 2**64 - 1], dtype=np.uint64)
if rank == size - 1:
    w[1] = 12345
mine = data(rank, 10)
done = offer(w, mine, F32)
check(done is False, "differing words reduced the data")
check(np.array_equal(w, [2**64 - 1, 12345]), f"AND of differing words: {w}")
check(all(torch.equal(m, x) for m, x in zip(mine, data(rank, 10))), "data changed without a reduction")
# 3. One rank only negotiates (band_allreduce) while the others offer data: False, AND right.
w = np.array([2**64 - 1, 6], dtype=np.uint64)
if rank == 0:
    shm.band_allreduce(w.ctypes.data, w.size)
    done = False
else:
    done = offer(w, data(rank, 11), F32)
check(done is False and np.array_equal(w, [2**64 - 1, 6]), "a rank without data was not seen")
# 4. Average as the optimizer sends it (prescale, postscale) in float64, then a plain sum on
#    the other half of the window: a slow reader must not see the later operation's data.
mine = data(rank, 12, torch.float64)
check(offer(np.ones(4, dtype=np.uint64), mine, F64, 0, 0.5, 2.0 / size) is True, "average not reduced")
want = [sum(data(r, 12, torch.float64)[i] for r in range(size)) / size for i in range(3)]
check(all(torch.allclose(m, x) for m, x in zip(mine, want)), "average differs from numpy")
x = torch.full((3000,), float(rank))
shm.allreduce([x.data_ptr()], [x.numel() * 4], F32, 0)
check(bool(torch.all(x == sum(range(size)))), "plain sum after a round's reduction")
# 5. Too much for one slot: a clear error, the window still usable.
big = torch.zeros(1 << 14)
try:
    offer(np.ones(2, dtype=np.uint64), [big], F32)
    failures.append("a batch larger than the slot was accepted")
except ValueError as exc:
    check("65536 bytes" in str(exc) and "2 words" in str(exc), f"unclear error: {exc}")
x = torch.ones(10)
shm.allreduce([x.data_ptr()], [40], F32, 0)
check(bool(torch.all(x == size)), "window unusable after the error")
report(failures)
'''


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_round_with_data_reduces_only_when_every_rank_offers_the_same(np_, tmp_path):
    _no_failures(run_ranks(np_, WINDOW_ROUND, tmp_path, timeout=120))


IN_ROUND_TRAINING = r'''
import os, copy
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # every rank on one core
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
import fusionring.torch as hvd
hvd.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
local_model = copy.deepcopy(model)  # the same parameters, without the optimizer's hooks
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
ok, steps = True, 20
before = hvd.communication_stats()
for step in range(steps):
    g = torch.Generator().manual_seed(100 * step + hvd.rank())
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    local_model.zero_grad()
    F.cross_entropy(local_model(x), y).backward()
    every = hvd.allgather_object([p.grad.numpy() for p in local_model.parameters()])
    for i, p in enumerate(model.parameters()):
        ok = ok and np.allclose(p.grad.numpy(), np.mean([e[i] for e in every], axis=0),
                                rtol=1e-5, atol=1e-6)
    if step % 5 == 4:  # something else between steps: a lone tensor of another dtype
        t = hvd.allreduce(torch.full((3,), float(hvd.rank()), dtype=torch.float64), op=hvd.Sum,
                          name=f"lone.{step}")
        ok = ok and bool(torch.all(t == sum(range(hvd.size()))))
after = hvd.communication_stats()
report({"ok": ok, "steps": steps,
        "in_round": after["batches_in_round"] - before["batches_in_round"],
        "batches": after["allreduce_batches"] - before["allreduce_batches"]})
'''


@pytest.mark.parametrize("np_", [2, 3])
def test_training_steps_are_reduced_within_their_round_and_match_numpy(np_, tmp_path):
    # All ranks on one core: more ranks than cores, so the round's AND goes through the
    # window and carries the step's gradients with it.
    results = run_ranks(np_, IN_ROUND_TRAINING, tmp_path, timeout=150,
                        env={"FUSIONRING_CYCLE_TIME_MS": "100"})
    for result in results:
        assert result["ok"], result
        # One batch per step and per lone tensor; all but the first of each name (new
        # names make a round a full exchange) go in their round.
        assert result["batches"] == result["steps"] + 4, result
        assert result["in_round"] >= result["batches"] - 5, result
