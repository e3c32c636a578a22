"""Launch-time settings: FUSIONRING_* variables and Horovod's names for the same knobs."""
from __future__ import annotations

import json

import pytest

from conftest import run_ranks
from fusionring.config import HOROVOD_VARIABLES, settings

_ALL = ["FUSIONRING_" + name for name in HOROVOD_VARIABLES] + list(HOROVOD_VARIABLES.values()) + [
    "HOROVOD_STALL_CHECK_DISABLE"]


@pytest.fixture
def env(monkeypatch):
    """Set variables for one settings() read; the cached settings are restored after."""
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)

    def read(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return settings(reload=True)

    yield read
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)
    settings(reload=True)


def test_defaults_without_variables(env):
    s = env()
    assert s.fusion_threshold_bytes == 64 * 1024 * 1024
    assert s.cycle_time_ms == 1.0
    assert s.timeline_path is None and s.timeline_mark_cycles
    assert s.stall_warning_s == 60.0 and s.stall_shutdown_s is None


def test_horovod_variables_keep_their_meaning(env):
    s = env(HOROVOD_FUSION_THRESHOLD="33554432", HOROVOD_CYCLE_TIME="3.5",
            HOROVOD_TIMELINE="/tmp/x/timeline.json", HOROVOD_TIMELINE_MARK_CYCLES="0",
            HOROVOD_STALL_CHECK_TIME_SECONDS="15", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="30")
    assert s.fusion_threshold_bytes == 33554432  # bytes in both libraries
    assert s.cycle_time_ms == 3.5  # milliseconds in both
    assert s.timeline_path == "/tmp/x/timeline.json" and not s.timeline_mark_cycles
    assert (s.stall_warning_s, s.stall_shutdown_s) == (15.0, 30.0)


def test_fusionring_variable_wins_over_horovods(env):
    s = env(HOROVOD_FUSION_THRESHOLD="0", FUSIONRING_FUSION_THRESHOLD="1024",
            HOROVOD_CYCLE_TIME="5", FUSIONRING_CYCLE_TIME_MS="2")
    assert s.fusion_threshold_bytes == 1024 and s.cycle_time_ms == 2.0


def test_horovod_zero_threshold_turns_fusion_off(env):
    assert env(HOROVOD_FUSION_THRESHOLD="0").fusion_threshold_bytes == 0


def test_dynamic_timeline_opens_no_file(env):
    # Horovod's HOROVOD_TIMELINE=DYNAMIC: nothing is written until start_timeline().
    assert env(HOROVOD_TIMELINE="DYNAMIC").timeline_path is None


def test_stall_check_disable(env):
    s = env(HOROVOD_STALL_CHECK_DISABLE="1", HOROVOD_STALL_CHECK_TIME_SECONDS="15",
            HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="30")
    assert s.stall_warning_s is None and s.stall_shutdown_s is None
    # An explicit fusionring setting still counts.
    s = env(FUSIONRING_STALL_SHUTDOWN_S="20")
    assert s.stall_warning_s is None and s.stall_shutdown_s == 20.0
    assert env(HOROVOD_STALL_CHECK_DISABLE="0").stall_warning_s == 15.0


def test_bad_value_names_the_variable_it_came_from(env):
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD='64MB'"):
        env(HOROVOD_FUSION_THRESHOLD="64MB")
    with pytest.raises(ValueError, match=r"HOROVOD_STALL_CHECK_DISABLE|expected 1 or 0"):
        env(HOROVOD_STALL_CHECK_DISABLE="maybe")


HOROVOD_ENV_JOB = """
import torch
import fusionring.torch as hvd
hvd.init()
tensors = [torch.full((1000,), float(hvd.rank() + i)) for i in range(6)]
before = hvd.communication_stats()["allreduce_batches"]
handles = [hvd.allreduce_async(t, name=f"t{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
outs = [hvd.synchronize(h) for h in handles]
batches = hvd.communication_stats()["allreduce_batches"] - before
ok = all(torch.equal(o, torch.full((1000,), float(sum(r + i for r in range(hvd.size())))))
         for i, o in enumerate(outs))
hvd.shutdown()
report({"batches": batches, "ok": ok})
"""


def test_horovod_environment_reaches_the_runtime(tmp_path):
    """A Horovod job's environment, unchanged: fusion off means one batch per tensor, and
    the timeline goes to HOROVOD_TIMELINE without cycle marks."""
    path = tmp_path / "timeline.json"
    results = run_ranks(2, HOROVOD_ENV_JOB, tmp_path, env={
        "HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_TIMELINE": str(path),
        "HOROVOD_TIMELINE_MARK_CYCLES": "0"})
    for r in results:
        assert r["ok"]
        assert r["batches"] == 6
    events = json.loads(path.read_text())
    assert any(e.get("name") == "reduce" for e in events)
    assert not any(e.get("name") == "cycle" for e in events)
