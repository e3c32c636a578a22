"""Launch-time settings: FUSIONRING_* variables and Horovod's names for the same knobs."""
from __future__ import annotations

import json

import pytest

from conftest import run_ranks
from fusionring.config import HOROVOD_VARIABLES, Settings, settings

_ALL = ["FUSIONRING_" + name for name in HOROVOD_VARIABLES] + list(HOROVOD_VARIABLES.values()) + [
    "HOROVOD_STALL_CHECK_DISABLE"]


@pytest.fixture
def env(monkeypatch):
    """Set variables for one settings() read; the cached settings are restored after."""
    for name in _ALL:
        monkeypatch.delenv(name, raising=False)

    touched = set(_ALL)

    def read(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        touched.update(variables)
        return settings(reload=True)

    yield read
    for name in touched:
        monkeypatch.delenv(name, raising=False)
    settings(reload=True)


def test_defaults_without_variables(env):
    s = env()
    assert s.fusion_threshold_bytes == 64 * 1024 * 1024
    assert s.cycle_time_ms == 1.0
    assert s.timeline_path is None and not s.timeline_mark_cycles   # off, as in Horovod
    assert s.stall_warning_s == 60.0 and s.stall_shutdown_s is None


def test_bursts_setting(env):
    assert env().bursts == "auto"
    assert env(FUSIONRING_BURSTS="0").bursts == "off"
    assert env(FUSIONRING_BURSTS="ON").bursts == "on"
    with pytest.raises(ValueError, match=r"FUSIONRING_BURSTS='sometimes': expected auto, on or off"):
        env(FUSIONRING_BURSTS="sometimes")


def test_nccl_setting(env):
    assert env().nccl == "auto"
    assert env(FUSIONRING_NCCL="off").nccl == "off"
    assert env(FUSIONRING_NCCL="1").nccl == "on"
    with pytest.raises(ValueError, match=r"FUSIONRING_NCCL='gpu': expected auto, on or off"):
        env(FUSIONRING_NCCL="gpu")


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


def test_cache_capacity_from_either_name(env):
    assert env().cache_capacity == 16384
    assert env(HOROVOD_CACHE_CAPACITY="1024").cache_capacity == 1024
    assert env(HOROVOD_CACHE_CAPACITY="1024", FUSIONRING_CACHE_CAPACITY="0").cache_capacity == 0
    with pytest.raises(ValueError, match="FUSIONRING_CACHE_CAPACITY='-3'"):
        env(FUSIONRING_CACHE_CAPACITY="-3")


def test_gradient_buffer_switch(env):
    assert env().gradient_buffer
    assert not env(FUSIONRING_GRADIENT_BUFFER="off").gradient_buffer
    # switches read as Horovod reads its own: a number above 0 is on
    assert env(FUSIONRING_GRADIENT_BUFFER="2").gradient_buffer
    assert not env(FUSIONRING_GRADIENT_BUFFER="-1").gradient_buffer
    with pytest.raises(ValueError, match="FUSIONRING_GRADIENT_BUFFER='sometimes': expected a number"):
        env(FUSIONRING_GRADIENT_BUFFER="sometimes")


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
    assert env(HOROVOD_STALL_CHECK_DISABLE="2").stall_warning_s is None  # Horovod: above 0 is on
    assert env(HOROVOD_TIMELINE_MARK_CYCLES="2").timeline_mark_cycles
    # strtol's reading of a decimal: its whole part
    assert env(HOROVOD_TIMELINE_MARK_CYCLES="1.0").timeline_mark_cycles
    assert not env(HOROVOD_TIMELINE_MARK_CYCLES="0.5").timeline_mark_cycles


def test_bad_value_names_the_variable_it_came_from(env):
    with pytest.raises(ValueError, match=r"HOROVOD_FUSION_THRESHOLD='64MB'"):
        env(HOROVOD_FUSION_THRESHOLD="64MB")
    with pytest.raises(ValueError, match=r"HOROVOD_STALL_CHECK_DISABLE='maybe': expected a number"):
        env(HOROVOD_STALL_CHECK_DISABLE="maybe")


def test_bad_switches_and_sizes_name_what_they_expect(env):
    with pytest.raises(ValueError, match=r"HOROVOD_STALL_CHECK_DISABLE='nan': expected a number"):
        env(HOROVOD_STALL_CHECK_DISABLE="nan")
    env(HOROVOD_STALL_CHECK_DISABLE="0")
    for raw in ("abc", "-1"):  # the least a segment may be is named, not 0
        with pytest.raises(ValueError, match=r"FUSIONRING_RING_SEGMENT_BYTES=.*of 1 or more"):
            env(FUSIONRING_RING_SEGMENT_BYTES=raw)


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
    assert any(e.get("name") == "RING_ALLREDUCE" for e in events)
    assert not any(e.get("name") == "CYCLE_START" for e in events)


# ------------------------------------------------------------------------------------------
# torch's intra-op threads per rank


class _Host:
    """The facts fit_intra_op_threads reads from a runtime: each local rank's cores."""

    def __init__(self, local_cores, local_rank=0):
        self.local_cores, self.local_rank = local_cores, local_rank
        self.local_size = len(local_cores)

    def _layout(self):
        from fusionring.runtime.topology import HostLayout
        return HostLayout(rank=self.local_rank, size=self.local_size, local_rank=self.local_rank,
                          local_size=self.local_size, local_cores=self.local_cores,
                          cross_rank=0, cross_size=1)

    def core_share(self):
        return self._layout().core_share()

    def host_cores(self):
        return self._layout().host_cores()


@pytest.mark.parametrize("local_cores, rank, share", [
    ([[0, 1]] * 4, 0, 0.5),  # 4 unbound ranks on 2 cores
    ([[0, 1]] * 2, 1, 1.0),
    ([list(range(32))] * 4, 2, 8.0),  # 4 unbound ranks on 32 cores
    ([[0, 1], [2, 3], [4, 5]], 1, 2.0),  # each bound to its own cores
    ([[0, 1], [1, 2]], 0, 1.5),  # core 1 shared, core 0 not
])
def test_core_share(local_cores, rank, share):
    assert _Host(local_cores, rank).core_share() == pytest.approx(share)


@pytest.mark.parametrize("local_cores, oversubscribed", [
    ([[0, 1]] * 4, True),   # 4 unbound ranks on 2 cores
    ([[0, 1]] * 2, False),
    ([[0], [0], [1]], True),  # two ranks bound to one core still make 3 ranks on 2 cores
    ([[0, 1], [2, 3], [4, 5]], False),
])
def test_oversubscribed(local_cores, oversubscribed):
    assert _Host(local_cores, 0)._layout().oversubscribed() is oversubscribed


def test_wait_policy_polls_briefly_then_naps_unless_told_to_spin(env):
    from fusionring.runtime.topology import HostLayout, wait_policy
    one_host = _Host([[0], [1]])._layout()
    two_hosts = HostLayout(rank=0, size=2, local_rank=0, local_size=1, local_cores=[[0]],
                           cross_rank=0, cross_size=2)
    assert wait_policy(env(), one_host) == (5000, 1000)
    assert wait_policy(env(), two_hosts) == (100, 1000)
    assert wait_policy(env(FUSIONRING_MPI_WAIT="spin"), one_host) == (0, 0)
    assert wait_policy(env(FUSIONRING_MPI_WAIT="sleep"), one_host) == (100, 1000)
    assert wait_policy(env(FUSIONRING_MPI_WAIT="auto", FUSIONRING_MPI_WAIT_SPIN_US="50",
                           FUSIONRING_MPI_WAIT_SLEEP_US="300"), one_host) == (50, 300)
    with pytest.raises(ValueError, match="FUSIONRING_MPI_WAIT_SPIN_US"):
        env(FUSIONRING_MPI_WAIT_SPIN_US="-1")


@pytest.fixture
def torch_threads(monkeypatch):
    import torch
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("FUSIONRING_TORCH_THREADS", raising=False)

    def fit(host, start, **variables):
        from fusionring.torch.threads import fit_intra_op_threads
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        settings(reload=True)
        torch.set_num_threads(start)
        changed = fit_intra_op_threads(host)
        return changed, torch.get_num_threads()

    yield fit
    monkeypatch.delenv("FUSIONRING_TORCH_THREADS", raising=False)
    settings(reload=True)
    torch.set_num_threads(before)


def test_oversubscribing_threads_are_lowered_to_the_rank_share(torch_threads, capsys):
    assert torch_threads(_Host([list(range(8))] * 4), 8) == (2, 2)
    assert "4 ranks share 8 cores" in capsys.readouterr().err
    assert torch_threads(_Host([[0, 1]] * 4, local_rank=1), 2) == (1, 1)
    assert capsys.readouterr().err == ""  # one note per host: local rank 0 prints it


def test_threads_never_raised_and_user_choices_kept(torch_threads):
    assert torch_threads(_Host([list(range(8))] * 2), 1) == (None, 1)  # lowered on purpose
    assert torch_threads(_Host([[0, 1]] * 4), 2, OMP_NUM_THREADS="2") == (None, 2)
    assert torch_threads(_Host([[0, 1]] * 4), 2, FUSIONRING_TORCH_THREADS="off") == (None, 2)
    assert torch_threads(_Host([[0, 1]] * 4), 2, FUSIONRING_TORCH_THREADS="3") == (3, 3)
    with pytest.raises(ValueError, match="FUSIONRING_TORCH_THREADS"):
        torch_threads(_Host([[0, 1]] * 4), 2, FUSIONRING_TORCH_THREADS="many")


THREADS_JOB = """
import os
import torch
from mpi4py import MPI
torch.set_num_threads(16)  # as torch's default on a 16-core host
import fusionring.torch as hvd
hvd.init()
cores = MPI.COMM_WORLD.allgather(sorted(os.sched_getaffinity(0)))
mine = cores[hvd.rank()]
share = sum(1.0 / sum(c in other for other in cores) for c in mine)
report({"threads": torch.get_num_threads(), "share": share})
"""


def test_init_fits_torch_threads_on_every_rank(tmp_path):
    for r in run_ranks(2, THREADS_JOB, tmp_path, timeout=60):
        assert r["threads"] == max(1, min(16, int(r["share"] + 1e-9)))
    chosen = run_ranks(2, THREADS_JOB, tmp_path, timeout=60, env={"OMP_NUM_THREADS": "16"})
    assert [r["threads"] for r in chosen] == [16, 16]


@pytest.mark.parametrize("variable,value", [
    ("FUSIONRING_CYCLE_TIME_MS", "-1"), ("FUSIONRING_CYCLE_TIME_MS", "inf"),
    ("FUSIONRING_CYCLE_TIME_MS", "nan"), ("HOROVOD_FUSION_THRESHOLD", "-5"),
    ("FUSIONRING_PACK_LIMIT", "-1"), ("FUSIONRING_RING_SEGMENT_BYTES", "0"),
    ("FUSIONRING_SMALL_MESSAGE_BYTES", "-1"), ("FUSIONRING_SHM_SLOT_BYTES", "1024"),
    ("FUSIONRING_STALL_WARNING_S", "nan"), ("FUSIONRING_SLOWDOWN", "0"),
    ("FUSIONRING_MPI_WAIT_SLEEP_US", "-1"),
])
def test_values_that_do_not_fit_are_refused_naming_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}='{value}'"):
        settings(reload=True)


def test_blank_values_count_as_unset_and_stall_times_up_to_zero_turn_the_check_off(monkeypatch):
    monkeypatch.setenv("FUSIONRING_FUSION_THRESHOLD", "  ")
    monkeypatch.setenv("FUSIONRING_STALL_WARNING_S", "-3")
    s = settings(reload=True)
    assert s.fusion_threshold_bytes == Settings().fusion_threshold_bytes
    assert s.stall_warning_s is None
    monkeypatch.undo()
    settings(reload=True)   # later tests in this process see the environment's own settings


def test_exit_hooks_do_nothing_in_a_child_forked_after_init():
    """A child of os.fork() that leaves with sys.exit ran fusionring's exit hooks too: it shut
    down and freed the parent's shared-memory window there, and hung in MPI it never joined."""
    import os

    from fusionring.state import _in_this_process

    calls = []
    hook = _in_this_process(lambda: calls.append(os.getpid()))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the hook, tell the parent whether it ran, leave at once
        hook()
        os.write(write, b"ran" if calls else b"skipped")
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"skipped"
    os.waitpid(pid, 0)
    hook()
    assert calls == [os.getpid()]
