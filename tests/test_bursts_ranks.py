"""Bursts (a backward pass's gradients negotiated in one round) and the negotiation's AND
through the shared-memory window."""
import pytest

from conftest import run_ranks

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
    results = run_ranks(np_, WINDOW_AND, tmp_path, timeout=120)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"


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
