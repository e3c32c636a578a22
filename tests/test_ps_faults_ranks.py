"""Faults under the parameter server: a worker that dies mid-training, a worker that finishes early."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT, mpiexec_path, run_ranks

DIES = r'''
import os, sys, time, torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync=sys.argv[1])
for step in range(100000):
    if k == 1 and step == 3:
        os._exit(1)  # dies: no ps.shutdown(), no MPI_Finalize
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
    time.sleep(0.005)
'''


def _launch(tmp_path, code, args, extra, timeout):
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FUSIONRING_STALL_SHUTDOWN_S="3", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.run([mpiexec_path(), *extra, "-n", "3", sys.executable, str(script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _launch_with_a_long_limit(tmp_path, code, args, extra, timeout):
    """As `_launch`, with a 60 s parameter-server time limit and no stall limit: what ends the job
    early is the failure itself, not a peer's time limit."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FUSIONRING_PS_TIMEOUT_S="60", PYTHONUNBUFFERED="1")
    env.pop("FUSIONRING_STALL_SHUTDOWN_S", None)
    start = time.monotonic()
    proc = subprocess.run([mpiexec_path(), *extra, "-n", "3", sys.executable, str(script), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _hydra() -> bool:
    out = subprocess.run([mpiexec_path(), "--version"], capture_output=True, text=True).stdout
    return "HYDRA" in out.upper()


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_a_dead_worker_fails_the_server_and_the_others_naming_it(tmp_path, sync):
    if not _hydra():
        pytest.skip("needs MPICH's mpiexec (-disable-auto-cleanup keeps the other ranks running)")
    # the launcher leaves the survivors running, so the parameter server itself must notice the death
    rc, output, took = _launch(tmp_path, DIES, [sync], ["-disable-auto-cleanup"], timeout=120)
    assert rc != 0
    # the server, and worker 0 through the server's message, name the dead worker
    assert output.count("worker 1 (rank 2) sent nothing for 3 s") >= 2, output[-3000:]
    assert "server rank 0: worker 1 (rank 2)" in output
    assert took < 100


def test_a_dead_worker_under_the_default_launcher_ends_the_job(tmp_path):
    rc, output, took = _launch(tmp_path, DIES, ["bsp"], [], timeout=120)
    assert rc != 0 and took < 100


EARLY = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
W, k = ps.num_workers(), ps.worker_rank()
steps_of = lambda j: 3 if j == 1 else 8   # worker 1 has fewer batches

def batch(worker, step):
    g = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)

def build():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 2)

model, ref = build(), build()
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                              named_parameters=model.named_parameters(), sync="bsp")
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
for step in range(steps_of(k)):
    x, y = batch(k, step)
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
for step in range(8):   # the reference: the average over the workers still training at each step
    grads = []
    for j in [j for j in range(W) if step < steps_of(j)]:
        ref.zero_grad(); xj, yj = batch(j, step)
        torch.nn.functional.mse_loss(ref(xj), yj).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    for i, p in enumerate(ref.parameters()):
        p.grad = sum(g[i] for g in grads) / len(grads)
    ref_opt.step()
s = ps.stats()
ps.shutdown()
report({"pushes": s["pushes"], "diff": max((a - b).abs().max().item()
                                            for a, b in zip(model.parameters(), ref.parameters()))})
'''


def test_a_worker_that_finishes_early_leaves_the_bsp_round_cleanly(tmp_path):
    results = run_ranks(4, EARLY, tmp_path, timeout=120)
    assert results[0] == {"server": True}
    assert [r["pushes"] for r in results[1:]] == [8, 3, 8]
    for k in (1, 3):  # the workers that ran to the end match the reference
        assert results[k]["diff"] < 1e-6, results[k]


ENDS_ON_AN_EXCEPTION = r'''
import sys, torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
bad = sys.argv[1] == "argument" and k == 1
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(),
                              sync="foo" if bad else "bsp")
for step in range(100000):
    if sys.argv[1] == "raise" and k == 1 and step == 3:
        raise RuntimeError("boom")
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
'''


@pytest.mark.parametrize("case,message", [
    ("argument", "worker 1 (rank 2): sync must be one of"),
    ("raise", "worker 1 (rank 2): RuntimeError: boom")])
def test_a_worker_ending_on_an_exception_fails_every_rank_at_once(tmp_path, case, message):
    """The worker tells the servers before its traceback, and they fail the job naming it,
    instead of waiting out their time limit for a silent worker."""
    if not _hydra():
        pytest.skip("needs MPICH's mpiexec (-disable-auto-cleanup keeps the other ranks running)")
    code, output, took = _launch_with_a_long_limit(tmp_path, ENDS_ON_AN_EXCEPTION, [case],
                                                   ["-disable-auto-cleanup"], timeout=120)
    assert code != 0
    # the server, and worker 0 through the server's message
    assert "server rank 0: " + message in output, output[-3000:]
    assert output.count(message) >= 2, output[-3000:]
    assert took < 40, took


RECORDED = r'''
import torch
from fusionring import ps
ps.init(num_servers=1)
model = torch.nn.Linear(3, 1)
try:
    ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                            named_parameters=model.named_parameters(), sync="bsp")
    report("no error")
except Exception as e:
    report(type(e).__name__ + ": " + str(e))
    raise
'''


def test_an_unwritable_record_path_fails_every_rank_at_the_start(tmp_path):
    path = str(tmp_path / "missing" / "record")
    results, rc, output = run_ranks(3, RECORDED, tmp_path, timeout=100, expect_failure=True,
                                    env={"FUSIONRING_PS_RECORD": path})
    assert rc != 0
    message = f"FUSIONRING_PS_RECORD={path!r}: server rank 0 cannot write its record to {path}.server0"
    assert message in output, output[-3000:]
    for r in results[1:]:   # the workers, in DistributedOptimizer(), before any training
        assert r is None or message in r, r
    assert any(r is not None for r in results[1:]), output[-3000:]


NO_OPTIMIZER = r'''
import sys, torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
if sys.argv[1] == "one" and k == 0:
    model = torch.nn.Linear(3, 1)
    opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
print(f"worker {k} shuts down", flush=True)
ps.shutdown()
'''


def test_workers_that_build_no_optimizer_end_the_job_cleanly(tmp_path):
    # ps.init() then ps.shutdown() on every worker: the server has nothing to serve and exits 0
    rc, output, took = _launch(tmp_path, NO_OPTIMIZER, ["none"], [], timeout=90)
    assert rc == 0, output[-3000:]
    assert output.count("shuts down") == 2
    # one worker builds an optimizer, the other shuts down first: an error naming both
    rc, output, took = _launch(tmp_path, NO_OPTIMIZER, ["one"], [], timeout=90)
    assert rc != 0
    assert "worker 1 called ps.shutdown() before building ps.DistributedOptimizer" in output, output[-3000:]
    assert "worker 0 built one" in output


INTERRUPTED = r'''
import time, torch
from fusionring import ps
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="asp")
for step in range(3):
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
if k == 0:
    time.sleep(100)  # busy outside the library
raise KeyboardInterrupt  # Ctrl-C on worker 1
'''


def test_ctrl_c_on_a_worker_ends_the_job_at_once(tmp_path):
    """MPI_Finalize would wait for the busy worker and the servers' time limit is long: the
    interrupted worker leaves unfinalized, and the launcher ends the job."""
    code, output, took = _launch_with_a_long_limit(tmp_path, INTERRUPTED, [], [], timeout=110)
    assert code != 0 and "KeyboardInterrupt" in output, output[-3000:]
    assert took < 30, (took, output[-3000:])
