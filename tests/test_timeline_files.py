"""The timeline file: loadable JSON whenever it was last flushed, what start_timeline does to a
file already being written, and paths rank 0 cannot write (every rank fails alike)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import run_ranks

from fusionring.timeline import Timeline

REPO = Path(__file__).resolve().parents[1]


def _lanes(events):
    return {e["args"]["name"] for e in events if e.get("ph") == "M"}


# ------------------------------------------------------------------------- one writer, no MPI

def test_the_file_is_a_json_array_after_every_flush(tmp_path):
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    assert json.loads(path.read_text()) == []
    now = time.perf_counter()
    timeline.span("a", "negotiate", now, now + 1e-3)
    timeline.flush()
    first = json.loads(path.read_text())
    assert [e["name"] for e in first] == ["thread_name", "NEGOTIATE_ALLREDUCE"]
    timeline.span("a", "operation", now, now + 2e-3)
    timeline.mark("MARK")
    timeline.flush()
    assert [e["name"] for e in json.loads(path.read_text())] == [
        "thread_name", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MARK"]
    timeline.span("b", "reduce", now, now + 2e-3)
    timeline.close()
    assert len(json.loads(path.read_text())) == 6
    timeline.close()  # closing twice changes nothing
    assert len(json.loads(path.read_text())) == 6


def test_spans_reach_the_file_in_batches(tmp_path):
    # No write per span: what a cycle records goes out at the next flush.
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    size = path.stat().st_size
    now = time.perf_counter()
    for i in range(100):
        timeline.span(f"t{i % 3}", "reduce", now, now)
    assert path.stat().st_size == size
    timeline.flush()
    assert len(json.loads(path.read_text())) == 103
    timeline.close()


KILLED_WRITER = """
import os, sys, time
from fusionring.timeline import Timeline
timeline = Timeline(sys.argv[1])
now = time.perf_counter()
for i in range(5):
    timeline.span("grad%d" % i, "reduce", now, now + 1e-3)
timeline.flush()
timeline.span("late", "reduce", now, now + 1e-3)  # recorded, never flushed
os._exit(9)
"""


def test_a_writer_killed_after_a_flush_leaves_a_loadable_file(tmp_path):
    path = tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path)], env=env,
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 9, done.stderr
    events = json.loads(path.read_text())
    assert _lanes(events) == {f"grad{i}" for i in range(5)}


def test_a_failed_write_stops_recording_and_leaves_a_loadable_file(tmp_path, monkeypatch,
                                                                   capsys):
    from fusionring import timeline as module
    path = tmp_path / "t.json"
    timeline = Timeline(str(path))
    now = time.perf_counter()
    timeline.span("kept", "reduce", now, now)
    timeline.flush()
    real, calls = os.pwrite, []

    def full_disk(fd, data, offset):  # part of the batch goes out, then the disk is full
        calls.append(offset)
        if len(calls) == 1:
            return real(fd, bytes(data[:7]), offset)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(module.os, "pwrite", full_disk)
    timeline.span("lost", "reduce", now, now)
    timeline.flush()
    assert "recording stopped" in capsys.readouterr().err
    timeline.span("later", "reduce", now, now)
    timeline.close()
    assert _lanes(json.loads(path.read_text())) == {"kept"}


def test_a_missing_directory_is_created(tmp_path):
    path = tmp_path / "new" / "dirs" / "t.json"
    Timeline(str(path)).close()
    assert json.loads(path.read_text()) == []


# ------------------------------------------------------------------------------- start_timeline

RESTARTS = r'''
import os, torch
import fusionring.torch as hvd
hvd.init()
out = os.environ["FR_TEST_OUT"]
a, b = os.path.join(out, "a.json"), os.path.join(out, "b.json")
def op(name):
    hvd.allreduce(torch.ones(4), name=name)
hvd.start_timeline(a)
op("first")
hvd.start_timeline(a, mark_cycles=True)   # the same file: recording goes on, with marks
op("second")
hvd.start_timeline(os.path.join(out, ".", "a.json"))  # the same file, spelled otherwise
op("third")
hvd.start_timeline(b)                     # another file: the first is closed
op("fourth")
hvd.stop_timeline()
hvd.stop_timeline()
op("after")
hvd.start_timeline(os.path.join(out, "missing", "dir", "c.json"))
op("fifth")
hvd.stop_timeline()
report({"ok": True})
'''


def test_start_timeline_again_keeps_or_closes_the_file_as_horovod_does(tmp_path):
    run_ranks(2, RESTARTS, tmp_path, timeout=90)
    out = tmp_path / "ranks2"
    first = json.loads((out / "a.json").read_text())
    assert {"allreduce.first", "allreduce.second", "allreduce.third"} <= _lanes(first)
    assert "allreduce.fourth" not in _lanes(first)
    assert any(e["name"] == "CYCLE_START" for e in first)
    second = json.loads((out / "b.json").read_text())
    assert "allreduce.fourth" in _lanes(second) and "allreduce.after" not in _lanes(second)
    third = json.loads((out / "missing" / "dir" / "c.json").read_text())
    assert "allreduce.fifth" in _lanes(third)


UNWRITABLE_START = r'''
import os, sys, torch
import fusionring.torch as hvd
hvd.init()
out = os.environ["FR_TEST_OUT"]
good = os.path.join(out, "good.json")
hvd.start_timeline(good)
hvd.allreduce(torch.ones(4), name="before")
errors = []
for bad in (out, "/proc/nope/x.json"):    # a directory; a directory that cannot be made
    try:
        hvd.start_timeline(bad)
        errors.append(None)
    except OSError as exc:
        errors.append(str(exc))
hvd.allreduce(torch.ones(4), name="after")  # still usable, still recording
hvd.stop_timeline()
report({"errors": errors, "out": out})
'''


def test_an_unwritable_start_timeline_path_raises_on_rank_0_and_recording_goes_on(tmp_path):
    """start_timeline is no collective (as in Horovod, a script may call it on rank 0 alone):
    rank 0, which writes the file, raises; the others have nothing to open."""
    results = run_ranks(2, UNWRITABLE_START, tmp_path, timeout=90)
    out = results[0]["out"]
    assert results[1]["errors"] == [None, None]
    for error, path in zip(results[0]["errors"], (out, "/proc/nope/x.json")):
        assert error is not None and "start_timeline" in error and repr(path) in error, error
        assert "rank 0" in error
    events = json.loads((tmp_path / "ranks2" / "good.json").read_text())
    assert {"allreduce.before", "allreduce.after"} <= _lanes(events)


UNWRITABLE_INIT = r'''
import torch
import fusionring.torch as hvd
try:
    hvd.init()
except OSError as exc:
    report({"error": str(exc)})
else:
    hvd.allreduce(torch.ones(4), name="x")
    report({"error": None})
'''


def test_an_unwritable_timeline_variable_fails_init_on_every_rank(tmp_path):
    directory = tmp_path / "adir"
    directory.mkdir()
    for variable, path in (("FUSIONRING_TIMELINE", str(directory)),
                           ("HOROVOD_TIMELINE", "/proc/nope/x.json")):
        results = run_ranks(2, UNWRITABLE_INIT, tmp_path, timeout=60, env={variable: path})
        errors = [r["error"] for r in results]
        assert errors[0] == errors[1], errors
        assert errors[0] and f"{variable}={path!r}" in errors[0] and "rank 0" in errors[0], errors


KILLED_RANK = r'''
import os, time, torch
import fusionring.torch as hvd
hvd.init()
for i in range(3):
    hvd.allreduce(torch.ones(4), name="x%d" % i)
time.sleep(1)
if hvd.rank() == 1:
    os._exit(3)
time.sleep(30)
'''


def test_the_file_loads_after_a_rank_dies(tmp_path):
    path = tmp_path / "killed.json"
    _, code, output = run_ranks(2, KILLED_RANK, tmp_path, timeout=60, expect_failure=True,
                                env={"FUSIONRING_TIMELINE": str(path)})
    assert code != 0, output
    events = json.loads(path.read_text())
    assert {"allreduce.x0", "allreduce.x1", "allreduce.x2"} <= _lanes(events)


RANK_0_ONLY = r'''
import os, torch
import fusionring.torch as hvd
hvd.init()
path = os.path.join(os.environ["FR_TEST_OUT"], "timeline_of_rank0.json")
if hvd.rank() == 0:
    hvd.start_timeline(path)
hvd.allreduce(torch.ones(4), name="x")
if hvd.rank() == 0:
    hvd.stop_timeline()
report({"ok": True})
'''


def test_start_timeline_on_rank_0_alone_records(tmp_path):
    results = run_ranks(2, RANK_0_ONLY, tmp_path, timeout=60)
    assert all(r["ok"] for r in results)
    events = json.loads((tmp_path / "ranks2" / "timeline_of_rank0.json").read_text())
    assert "allreduce.x" in _lanes(events)


PS_JOB = r'''
import atexit, torch
from mpi4py import MPI
from fusionring import ps
if MPI.COMM_WORLD.Get_rank() == 0:
    atexit.register(report, "server")
ps.init(num_servers=1)
model = torch.nn.Linear(3, 1)
opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), sync="bsp")
for step in range(3):
    opt.zero_grad(); model(torch.ones(2, 3)).sum().backward(); opt.step()
ps.shutdown()
report("worker")
'''


def test_a_parameter_server_writes_one_update_span_per_update(tmp_path):
    import json
    path = tmp_path / "trace.json"
    assert run_ranks(3, PS_JOB, tmp_path, env={"FUSIONRING_TIMELINE": str(path)}) == \
        ["server", "worker", "worker"]
    assert not path.exists()  # the server's own file, beside the path
    events = json.loads((tmp_path / "trace.json.ps0").read_text())
    updates = [e for e in events if e["name"] == "UPDATE"]
    assert [e["args"]["version"] for e in updates] == [1, 2, 3]
    assert all(e["args"]["workers"] == [0, 1] and e["ph"] == "X" and e["dur"] >= 0 for e in updates)
