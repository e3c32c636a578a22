"""Checkpoints of a parameter-server job: N + M steps in one job equal N steps, ps.save (or state_dict()), and a
new job that loads the state and runs M steps, bit for bit under bsp (with each worker's compression residuals
restored from its own file or dict); and loading misuse is an error."""
import os

import pytest

from conftest import run_ranks

SCRIPT = r'''
import atexit, sys, torch
from mpi4py import MPI
from fusionring import ps
mode, path, N, M = sys.argv[1], sys.argv[2], 4, 3
import fusionring.torch as hvd
compression = {"none": hvd.Compression.none, "nm": hvd.Compression.nm(2, 4, shared_mask=False),
               "cluster": hvd.Compression.cluster(k=4, sample=16)}[COMPRESSION]
if MPI.COMM_WORLD.Get_rank() < 2:
    atexit.register(report, {"server": True})
ps.init(num_servers=2)
k = ps.worker_rank()
torch.manual_seed(100 + k + (7 if mode.startswith("resume") else 0))  # worker 0's (or the saved) values win
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
opt = ps.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01),
                              named_parameters=model.named_parameters(), sync="bsp",
                              compression=compression)

def steps(first, count):
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + k)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()

out = {}
if mode == "full":
    steps(0, N + M)
elif mode == "save":
    steps(0, N)
    ps.save(path)                               # worker 0 asks the servers; each worker writes its residuals
    state = opt.state_dict()
    torch.save(state, path + f".dict{k}")       # each worker keeps its own dict
else:
    source = {"resume_file": path, "resume_dict": path + f".dict{k}", "resume_swapped": path + f".dict{1 - k}"}[mode]
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(torch.load(source, weights_only=False))
    out["warnings"] = [str(w.message) for w in caught if "ps worker" in str(w.message)]
    out["iteration"] = opt._iteration
    steps(N, M)
out["params"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
out["bits"] = [p.detach().numpy().tobytes().hex() for p in model.parameters()]
ps.shutdown()
report(out)
'''


@pytest.mark.parametrize("compression", ["none", "nm", "cluster"])
def test_a_resumed_bsp_run_continues_bit_for_bit(compression, tmp_path):
    (tmp_path / "ckpt").mkdir()
    path = str(tmp_path / "ckpt" / "ps.pt")
    run = lambda mode: run_ranks(4, SCRIPT.replace("sys.argv[1], sys.argv[2]", f"{mode!r}, {path!r}").replace(
        "[COMPRESSION]", f"[{compression!r}]"), tmp_path / mode, timeout=150)
    full = run("full")
    saved = run("save")
    own = [] if compression == "none" else ["ps.pt.worker0", "ps.pt.worker1"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(["ps.pt", "ps.pt.dict0", "ps.pt.dict1", "ps.pt.server0", "ps.pt.server1"]
                                       + own)
    assert saved[2]["bits"] != full[2]["bits"]  # N steps are not N + M steps
    for mode in ("resume_file", "resume_dict"):
        resumed = run(mode)
        for k in (2, 3):
            assert resumed[k]["iteration"] == 4
            assert resumed[k]["warnings"] == []
            assert resumed[k]["bits"] == full[k]["bits"], mode
    if compression != "none":
        # Another worker's dict: its residuals are not loaded, and the worker says so.
        swapped = run("resume_swapped")
        for k in (2, 3):
            assert swapped[k]["warnings"] == [
                f"ps worker {k - 2}: the checkpoint holds worker {3 - k}'s state, not this worker's; its "
                f"compression residuals and layer selection start empty (call ps.save on every worker, or "
                f"give each worker its own state_dict())"]
            assert swapped[k]["bits"] != full[k]["bits"]


MISUSE = r'''
import torch
from fusionring import ps
ps.init(num_servers=1)
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              sync="bsp")
try:
    opt.load_state_dict({"format": "something else"})
    bad_dict = None
except ValueError as e:
    bad_dict = str(e)
opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
state = opt.state_dict()
try:
    opt.load_state_dict(state)  # after training started
    late = None
except Exception as e:
    late = type(e).__name__ + ": " + str(e)
report({"bad_dict": bad_dict, "late": late})
'''


def test_loading_state_after_training_started_fails_on_every_worker(tmp_path):
    results, rc, output = run_ranks(3, MISUSE, tmp_path, timeout=120, expect_failure=True)
    assert rc != 0
    for r in results[1:]:
        assert r is not None, output
        assert "state_dict" in r["bad_dict"]
        assert r["late"] is not None and "load_state_dict()" in r["late"] and "before step()" in r["late"], r


SCHEDULED = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
MODE, PATH, HOW, N, M = @MODE@, @PATH@, @HOW@, 3, 4
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
k = ps.worker_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
inner = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
opt = ps.DistributedOptimizer(inner, named_parameters=model.named_parameters(), sync="bsp")
first, last = (0, N) if MODE == "save" else (0, N + M) if MODE == "full" else (N, N + M)
if MODE == "resume":   # as for any torch resume: the optimizer's state, then the scheduler's
    opt.load_state_dict(torch.load(PATH if HOW == "file" else PATH + f".dict{k}"))
    sched.load_state_dict(torch.load(PATH + f".sched{k}"))
lrs = []
for step in range(first, last):
    g = torch.Generator().manual_seed(1000 * step + k)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    lrs.append(inner.param_groups[0]["lr"])
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    sched.step()
if MODE == "save":
    ps.save(PATH)
    torch.save(opt.state_dict(), PATH + f".dict{k}")
    torch.save(sched.state_dict(), PATH + f".sched{k}")
ps.shutdown()
report({"lrs": lrs, "bits": [p.detach().numpy().tobytes().hex() for p in model.parameters()]})
'''


def test_a_resumed_run_with_an_lr_scheduler_continues_bit_for_bit(tmp_path):
    """The learning rate a scheduler had set is restored with the optimizer's state (as torch's
    Optimizer.load_state_dict does) and reaches the servers with the first push."""
    path = str(tmp_path / "sched.pt")

    def run(mode, how="file"):
        code = SCHEDULED.replace("@MODE@", repr(mode)).replace("@PATH@", repr(path)).replace("@HOW@", repr(how))
        return run_ranks(3, code, tmp_path / f"{mode}_{how}", timeout=120)

    full = run("full")
    assert full[1]["lrs"] == [0.2, 0.2, 0.1, 0.1, 0.05, 0.05, 0.025]   # the schedule, by hand
    run("save")
    for how in ("file", "dict"):
        resumed = run("resume", how)
        for k in (1, 2):
            assert resumed[k]["lrs"] == full[k]["lrs"][3:], how
            assert resumed[k]["bits"] == full[k]["bits"], how


ONLY_ONE_LOADS = r'''
import atexit, time, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 1:
    atexit.register(report, "server")
ps.init(num_servers=1)
k = ps.worker_rank()
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              sync="@SYNC@")
if "@WHO@" == "make":
    opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
    ps.save(@PATH@)
    ps.shutdown()
    report("saved")
else:
    try:
        if k == 0:
            if "@WHO@" == "late":
                time.sleep(1.0)   # worker 1's push arrives first
            opt.load_state_dict(torch.load(@PATH@))
        for step in range(40):   # under asp, still training when worker 0 loads
            opt.zero_grad(); model(torch.randn(2, 3)).sum().backward(); opt.step()
            time.sleep(0.05)
        report("no error")
    except Exception as e:
        report(type(e).__name__ + ": " + str(e))
        raise
'''


@pytest.mark.parametrize("sync,who", [("bsp", "late"), ("bsp", "early"), ("asp", "late")])
def test_a_worker_that_skips_load_state_dict_is_the_one_named(tmp_path, sync, who):
    path = str(tmp_path / "one.pt")
    make = ONLY_ONE_LOADS.replace("@SYNC@", sync).replace("@PATH@", repr(path))
    run_ranks(3, make.replace("@WHO@", "make"), tmp_path / "make", timeout=120)
    results, rc, output = run_ranks(3, make.replace("@WHO@", who), tmp_path / who, timeout=120,
                                    expect_failure=True)
    assert rc != 0
    assert results[1] is not None, output[-3000:]   # worker 0, waiting in load_state_dict()
    if sync == "bsp":
        assert results[2] is not None, output[-3000:]   # worker 1, held for the round
    for message in [r for r in results[1:] if r is not None]:   # (under asp worker 1 may be ended first)
        assert "worker 1 did not call load_state_dict() (worker 0 did" in message, message
        assert "worker 0 called" not in message


THREE_WORKERS = r'''
import atexit, sys, time, torch
from mpi4py import MPI
from fusionring import ps
mode, path, sync, N, M = MODE, PATH, SYNC, 4, 3
if MPI.COMM_WORLD.Get_rank() == 0:
    atexit.register(report, {"server": True})
ps.init(num_servers=1)
k = ps.worker_rank()
torch.manual_seed(100)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              named_parameters=model.named_parameters(), sync=sync,
                              **({"staleness": 1} if sync == "ssp" else {}))

def steps(first, count):
    for step in range(first, first + count):
        if sync == "bsp":
            time.sleep(0.01 * ((step + k) % 3))   # the workers arrive in changing orders
        g = torch.Generator().manual_seed(1000 * step + k)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()

out = {}
if mode == "full":
    steps(0, N + M)
elif mode == "save":
    steps(0, N)
    if sync == "ssp" and k == 1:
        ps.shutdown()                            # this worker is done before the save
        report({"left": True})
        sys.exit(0)
    if sync == "ssp":
        time.sleep(1.0)
    ps.save(path)
    out["state_keys"] = sorted(opt.state_dict())
else:
    opt.load_state_dict(torch.load(path, weights_only=False))
    steps(N, M)
out["bits"] = [p.detach().numpy().tobytes().hex() for p in model.parameters()]
ps.shutdown()
report(out)
'''


def _three_workers(tmp_path, sync, mode, env=None):
    path = str(tmp_path / "ckpt.pt")
    code = (THREE_WORKERS.replace("MODE", repr(mode)).replace("PATH", repr(path))
            .replace("SYNC", repr(sync)))
    return run_ranks(4, code, tmp_path / f"{sync}-{mode}", timeout=150, env=env)


def test_bsp_with_three_workers_and_no_time_limit_saves_and_resumes_bit_for_bit(tmp_path):
    """Three workers arriving in changing orders: the server sums in worker order, so a run is
    the same bits every time and a resumed one equals it; with no time limit
    (FUSIONRING_PS_TIMEOUT_S=0) ps.save and state_dict() wait without one."""
    env = {"FUSIONRING_PS_TIMEOUT_S": "0"}
    full = _three_workers(tmp_path, "bsp", "full", env)
    again = _three_workers(tmp_path / "again", "bsp", "full", env)
    saved = _three_workers(tmp_path, "bsp", "save", env)
    assert saved[1]["state_keys"] == ["format", "num_servers", "param_groups", "servers", "shards",
                                      "worker"]
    resumed = _three_workers(tmp_path, "bsp", "resume", env)
    for k in (1, 2, 3):
        assert again[k]["bits"] == full[k]["bits"]
        assert resumed[k]["bits"] == full[k]["bits"]


def test_ssp_resumes_from_a_save_made_after_a_worker_shut_down(tmp_path):
    saved = _three_workers(tmp_path, "ssp", "save")
    assert saved[2] == {"left": True}
    resumed = _three_workers(tmp_path, "ssp", "resume", {"FUSIONRING_PS_TIMEOUT_S": "20"})
    for k in (1, 2, 3):
        assert len(resumed[k]["bits"]) == 4


SAVE_FAILURES = r'''
import atexit, os, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() < 2:
    atexit.register(report, {"server": True})
ps.init(num_servers=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="asp")

def step():
    opt.zero_grad(); model(torch.ones(2, 5)).sum().backward(); opt.step()

out = {}
step()
try:
    ps.save(os.path.join(@DIR@, "missing", "ckpt.pt"))
except FileNotFoundError as exc:
    out["missing"] = str(exc)
blocked = os.path.join(@DIR@, "blocked.pt")
os.makedirs(blocked + ".server1")               # server 1 cannot write its file there
try:
    ps.save(blocked)
except OSError as exc:
    out["server"] = str(exc)
step()
ps.save(os.path.join(@DIR@, "good.pt"))         # the job goes on and saves
out["good"] = sorted(f for f in os.listdir(@DIR@) if f.startswith("good"))
step()
ps.shutdown()
report(out)
'''


def test_a_save_that_cannot_be_written_raises_on_the_worker_and_the_job_goes_on(tmp_path):
    results = run_ranks(3, SAVE_FAILURES.replace("@DIR@", repr(str(tmp_path))), tmp_path / "run",
                        timeout=120)
    out = results[2]
    assert "does not exist" in out["missing"] and "missing" in out["missing"], out
    assert "server rank 1 could not write" in out["server"], out
    assert "blocked.pt.server1" in out["server"], out
    assert out["good"] == ["good.pt", "good.pt.server0", "good.pt.server1"], out
