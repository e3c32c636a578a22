"""Straggler emulation (fusionrun --slow): where the extra time is slept, and how much."""

import pytest

from conftest import run_ranks
from fusionring import straggler


class FakeClock:
    def __init__(self):
        self.now, self.slept = 0.0, []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(straggler, "time", fake)
    return fake


def test_the_first_gradient_waits_for_the_last_steps_compute_stretched(clock):
    s = straggler.Straggler(3.0)
    clock.now = 1.0                      # forward done, first gradient ready
    s.gradient_ready()                   # first step: what has passed stands for the compute
    assert clock.slept == [2.0]
    s.gradient_ready()                   # later gradients of the step pass at once
    assert clock.slept == [2.0]
    clock.now += 2.0                     # the rest of backward
    s.step()                             # compute 1 + 2 = 3 s, not counting the 2 s slept
    assert clock.slept == [2.0]
    clock.now += 0.5
    s.step_ended()
    clock.now += 1.0
    s.gradient_ready()                   # the last step's 3 s of compute, stretched 3x
    assert clock.slept == [2.0, 6.0]


def test_without_gradient_hooks_the_step_itself_waits(clock):
    s = straggler.Straggler(2.5)         # a parameter-server worker pushes in step()
    clock.now = 4.0
    s.step()
    assert clock.slept == [6.0]
    s.step_ended()
    clock.now += 1.0
    s.step()
    assert clock.slept == [6.0, 1.5]


def test_a_factor_of_one_or_less_makes_none(monkeypatch):
    from fusionring.config import settings
    monkeypatch.setenv("FUSIONRING_SLOWDOWN", "1")
    settings(reload=True)
    try:
        assert straggler.Straggler.from_settings() is None
    finally:
        monkeypatch.delenv("FUSIONRING_SLOWDOWN")
        settings(reload=True)


SLOW_RANK = r'''
import sys, torch
import fusionring.torch as hvd
from fusionring import straggler
hvd.init()
where = []
real_sleep = straggler.time.sleep

class Recording:
    perf_counter = staticmethod(straggler.time.perf_counter)
    @staticmethod
    def sleep(seconds):
        frame, names = sys._getframe(1), []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        where.append("_on_grad_ready" in names)
        real_sleep(min(seconds, 0.05))

straggler.time = Recording
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
for step in range(3):
    x = torch.full((4, 8), float(hvd.rank() + step))
    opt.zero_grad(); model(x).sum().backward(); opt.step()
report({"where": where, "weight": model.weight.sum().item()})
'''


def test_the_slow_rank_sleeps_inside_backward_before_handing_its_first_gradient_on(tmp_path):
    slow = run_ranks(2, SLOW_RANK, tmp_path / "slow", env={"FUSIONRING_SLOWDOWN": "3"})
    plain = run_ranks(2, SLOW_RANK, tmp_path / "plain", env={"FUSIONRING_SLOWDOWN": "1"})
    for r in slow:
        assert r["where"] == [True, True, True], r   # one sleep a step, in the gradient hook
        assert r["weight"] == plain[0]["weight"]
    assert plain[0]["where"] == [] and plain[0]["weight"] == plain[1]["weight"]


SLOW_WORKER = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps, straggler
if MPI.COMM_WORLD.Get_rank() == 0:
    atexit.register(report, "server")
ps.init(num_servers=1)
pushes_at_sleep = []

class Recording:
    perf_counter = staticmethod(straggler.time.perf_counter)
    @staticmethod
    def sleep(seconds):
        pushes_at_sleep.append(ps.stats()["pushes"])

straggler.time = Recording
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp")
for step in range(3):
    opt.zero_grad(); model(torch.ones(2, 3)).sum().backward(); opt.step()
ps.shutdown()
report(pushes_at_sleep)
'''


def test_a_slow_parameter_server_worker_sleeps_before_each_push(tmp_path):
    results = run_ranks(3, SLOW_WORKER, tmp_path, env={"FUSIONRING_SLOWDOWN": "2"})
    assert results == ["server", [0, 1, 2], [0, 1, 2]]
