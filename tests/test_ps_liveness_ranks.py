"""A worker's liveness under the parameter server: a worker busy for longer than the stall limit between pushes
(evaluation, a checkpoint) is alive and waited for; one whose interpreter is frozen is detected within the limit;
a limit <= 0 means no limit; hvd.init() after ps.init() fails at once instead of hanging."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, mpiexec_path, run_ranks

PAUSE = r'''
import atexit, sys, time, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
SYNC, PAUSE_S, STEPS = "@SYNC@", @PAUSE@, 6
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))

def batch(worker, step):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)

model, ref = build(), build()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              named_parameters=model.named_parameters(), sync=SYNC)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
for step in range(STEPS):
    if k == 0 and step == 2:
        time.sleep(PAUSE_S)  # an evaluation or a checkpoint: longer than the stall limit, between two pushes
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    grads = []
    for j in range(W):
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    for i, p in enumerate(ref.parameters()):
        p.grad = sum(g[i] for g in grads) / W
    ref_opt.step()
s = ps.stats()
ps.shutdown()
report({"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())),
        "pushes": s["pushes"], "version": s["version"]})
'''


def _pause(sync, pause):
    return PAUSE.replace("@SYNC@", sync).replace("@PAUSE@", repr(pause))


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_a_worker_busy_longer_than_the_limit_between_pushes_is_not_taken_for_dead(tmp_path, sync):
    """Worker 0 pauses 5 s with a 2 s limit: under bsp worker 1 waits for it (with a warning) and the run is the
    single-process average; under asp worker 1 goes on alone and every push is applied."""
    results, rc, output = run_ranks(3, _pause(sync, 5.0), tmp_path, timeout=120, expect_failure=True,
                                    env={"FUSIONRING_PS_TIMEOUT_S": "2", "FUSIONRING_STALL_WARNING_S": "1"})
    assert rc == 0, output[-3000:]
    assert results[0] == {"server": True}
    assert [r["pushes"] for r in results[1:]] == [6, 6]
    assert "StallError" not in output
    if sync == "bsp":
        for r in results[1:]:
            assert r["diff"] < 1e-6, r
        assert "workers [1] wait for worker 0 (rank 1), alive but without a push" in output, output[-3000:]
    else:
        assert max(r["version"] for r in results[1:]) == 12  # asp: one update per push, none lost


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_limit_of_zero_or_less_means_no_limit(tmp_path, value):
    results = run_ranks(3, _pause("bsp", 1.0), tmp_path, timeout=120,
                        env={"FUSIONRING_PS_TIMEOUT_S": value, "FUSIONRING_STALL_SHUTDOWN_S": ""})
    for r in results[1:]:
        assert r["diff"] < 1e-6 and r["pushes"] == 6, r


FROZEN = r'''
import ctypes, time, torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="@SYNC@")
for step in range(100000):
    if k == 1 and step == 3:
        ctypes.PyDLL(None).sleep(60)  # a C call that keeps the GIL: the whole interpreter is frozen
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
    time.sleep(0.005)
'''


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_a_worker_whose_interpreter_is_frozen_is_detected_within_the_limit(tmp_path, sync):
    script = tmp_path / "frozen.py"
    script.write_text(textwrap.dedent(FROZEN.replace("@SYNC@", sync)))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FUSIONRING_PS_TIMEOUT_S="2", PYTHONUNBUFFERED="1")
    env.pop("FUSIONRING_STALL_SHUTDOWN_S", None)
    start = time.monotonic()
    proc = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    took, output = time.monotonic() - start, proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "worker 1 (rank 2) sent nothing for 2 s, not even its heartbeat" in output, output[-3000:]
    assert took < 40, took  # well before the frozen call's 60 s


HVD_INIT = r'''
import sys, torch
import fusionring.torch as hvd
from fusionring import ps
if sys.argv[1] == "before":
    hvd.init()
ps.init(num_servers=1)
if sys.argv[1] == "after":
    hvd.init()
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp")
for step in range(3):
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
ps.shutdown()
print(f"worker {k} done", flush=True)
'''


@pytest.mark.parametrize("where", ["before", "after"])
def test_hvd_init_after_ps_init_fails_at_once_saying_what_to_do(tmp_path, where):
    script = tmp_path / "hvd_init.py"
    script.write_text(textwrap.dedent(HVD_INIT))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FUSIONRING_PS_TIMEOUT_S="60", PYTHONUNBUFFERED="1")
    env.pop("FUSIONRING_STALL_SHUTDOWN_S", None)
    start = time.monotonic()
    proc = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(script), where], env=env,
                          capture_output=True, text=True, timeout=150, cwd=str(tmp_path))
    took, output = time.monotonic() - start, proc.stdout + proc.stderr
    if where == "before":  # every rank, servers included, before the servers start serving: allowed
        assert proc.returncode == 0, output[-3000:]
        assert "worker 0 done" in output and "worker 1 done" in output
        return
    assert proc.returncode != 0
    assert "hvd.init() was called after ps.init()" in output, output[-3000:]
    assert "Call hvd.init() on every rank before ps.init()" in output
    assert took < 30, took  # not after the 60 s limit
