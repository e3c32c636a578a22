"""fusionrun with horovodrun's tuning options: what each rank's settings end up as, whichever
way (command line, --config-file, both) and in whatever order they are given."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from fusionring import launcher as run
from fusionring.config import Settings, _from_environment

REPO = Path(__file__).resolve().parents[1]
MPICH_VERSION = "HYDRA build details:\n    Version:                                 4.1.2\n"


def _launch(args: List[str], environ: Optional[Dict[str, str]] = None) -> run.Launch:
    request = run.parse_args(["-np", "2", *args, "python", "t.py"])
    return run.build_launch(request, "mpiexec", run.MPICH, running_as_root=False,
                            environ={} if environ is None else environ)


def _rank_settings(args: List[str], monkeypatch, environ: Optional[Dict[str, str]] = None
                   ) -> Settings:
    """The settings a rank reads back when launched with `args` from a shell with `environ`."""
    environ = environ or {}
    for name in list(os.environ):
        if name.startswith(("FUSIONRING_", "HOROVOD_")):
            monkeypatch.delenv(name)
    for name, value in {**environ, **_launch(args, environ).env_added}.items():
        monkeypatch.setenv(name, value)
    return _from_environment()


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hvd.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


OFF_YAML = """\
stall_check:
  enabled: false
timeline:
  filename: x.json
  mark_cycles: true
"""


# ------------------------------------------------------------------------------ cycle markers

def test_a_timeline_filename_alone_marks_no_cycles(monkeypatch):
    # horovodrun's --timeline-mark-cycles is off unless given.
    settings = _rank_settings(["--timeline-filename", "t.json"], monkeypatch)
    assert settings.timeline_path == "t.json" and not settings.timeline_mark_cycles


def test_timeline_mark_cycles_turns_markers_on(monkeypatch):
    settings = _rank_settings(["--timeline-filename", "t.json", "--timeline-mark-cycles"],
                              monkeypatch)
    assert settings.timeline_mark_cycles


def test_no_timeline_mark_cycles_turns_markers_off(monkeypatch):
    settings = _rank_settings(["--timeline-filename", "t.json", "--no-timeline-mark-cycles"],
                              monkeypatch)
    assert not settings.timeline_mark_cycles


def test_a_launching_shells_mark_cycles_variable_is_kept(monkeypatch):
    # As with horovodrun, which leaves the variable alone unless an option sets it.
    settings = _rank_settings(["--timeline-filename", "t.json"], monkeypatch,
                              environ={"HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert settings.timeline_mark_cycles
    settings = _rank_settings(["--timeline-filename", "t.json", "--no-timeline-mark-cycles"],
                              monkeypatch, environ={"HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert not settings.timeline_mark_cycles


def test_mark_cycles_false_in_a_config_file_turns_markers_off(monkeypatch, tmp_path):
    config = _config(tmp_path, "timeline:\n  filename: t.json\n  mark_cycles: false\n")
    settings = _rank_settings(["--config-file", config], monkeypatch)
    assert settings.timeline_path == "t.json" and not settings.timeline_mark_cycles


def test_no_timeline_mark_cycles_overrides_the_config_file(monkeypatch, tmp_path):
    config = _config(tmp_path, OFF_YAML)
    assert _rank_settings(["--config-file", config], monkeypatch).timeline_mark_cycles
    for args in (["--config-file", config, "--no-timeline-mark-cycles"],
                 ["--no-timeline-mark-cycles", "--config-file", config]):
        assert not _rank_settings(args, monkeypatch).timeline_mark_cycles, args


# -------------------------------------------------------------------------------- stall check

def test_stall_check_on_the_command_line_overrides_the_config_file(monkeypatch, tmp_path):
    config = _config(tmp_path, OFF_YAML)
    off = _rank_settings(["--config-file", config], monkeypatch)
    assert off.stall_warning_s is None and off.stall_shutdown_s is None
    for args in (["--config-file", config, "--stall-check"],
                 ["--stall-check", "--config-file", config]):
        on = _rank_settings(args, monkeypatch)
        assert on.stall_warning_s == Settings().stall_warning_s, args
    on = _rank_settings(["--config-file", config, "--stall-check",
                         "--stall-check-warning-time-seconds", "7"], monkeypatch)
    assert on.stall_warning_s == 7.0


def test_stall_check_overrides_the_launching_shells_disable_variable(monkeypatch):
    environ = {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    assert _rank_settings([], monkeypatch, environ).stall_warning_s is None
    assert _rank_settings(["--stall-check"], monkeypatch, environ).stall_warning_s is not None


@pytest.mark.parametrize("args", [
    ["--no-stall-check", "--stall-check-warning-time-seconds", "1"],
    ["--stall-check-warning-time-seconds", "1", "--no-stall-check"],
    ["--no-stall-check", "--stall-check-shutdown-time-seconds", "5",
     "--stall-check-warning-time-seconds", "1"],
])
def test_no_stall_check_wins_whatever_the_order(monkeypatch, args):
    settings = _rank_settings(args, monkeypatch)
    assert settings.stall_warning_s is None and settings.stall_shutdown_s is None


def test_a_disabled_stall_check_in_the_config_file_outranks_time_options(monkeypatch, tmp_path):
    # horovodrun: the file's enabled: false stands, and disabling outranks the times.
    config = _config(tmp_path, OFF_YAML)
    settings = _rank_settings(["--config-file", config, "--stall-check-warning-time-seconds",
                               "3"], monkeypatch)
    assert settings.stall_warning_s is None and settings.stall_shutdown_s is None


def test_no_stall_check_stops_the_warnings_of_a_real_run(tmp_path):
    """The audit's case: rank 1 arrives 4 s late; with the stall check off no rank warns."""
    script = tmp_path / "late.py"
    script.write_text("import time, torch, fusionring.torch as hvd\nhvd.init()\n"
                      "if hvd.rank() == 1:\n    time.sleep(4)\n"
                      "hvd.allreduce(torch.ones(2), name='late')\nhvd.shutdown()\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in [n for n in env if n.startswith(("FUSIONRING_STALL", "HOROVOD_STALL"))]:
        del env[name]
    done = subprocess.run([sys.executable, "-m", "fusionring.launcher", "-np", "2",
                           "--no-stall-check", "--stall-check-warning-time-seconds", "1",
                           sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "waiting for the rest" not in done.stderr, done.stderr


# ------------------------------------------------------------------ options fusionring lacks

def _fusionrun(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"#!{sys.executable}\nimport sys\n"
                       f"if sys.argv[1:] == ['--version']:\n    print({MPICH_VERSION!r})\n")
    mpiexec.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fusionring.launcher", "--mpiexec", str(mpiexec),
                           "--dry-run", "-np", "2", *args, "python", "t.py"], cwd=REPO, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)


def test_torus_allreduce_is_accepted_with_a_note(tmp_path):
    done = _fusionrun("--torus-allreduce", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout)[1:] == ["-n", "2", "python", "t.py"]
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("fusionrun: ignoring horovodrun's --torus-allreduce: ")
    done = _fusionrun("--no-torus-allreduce", tmp_path=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr  # what fusionring does anyway
    assert shlex.split(done.stdout)[1:] == ["-n", "2", "python", "t.py"]


def test_torus_allreduce_in_a_config_file_gets_the_same_note(tmp_path):
    config = _config(tmp_path, "params:\n  torus_allreduce: true\n")
    done = _fusionrun("--config-file", config, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no such setting" not in done.stderr
    assert f"ignoring params.torus_allreduce in {config}: " in done.stderr
    config = _config(tmp_path, "params:\n  torus_allreduce: false\n")
    done = _fusionrun("--config-file", config, tmp_path=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr


# ---------------------------------------------------------------------- launch-time checks

@pytest.mark.parametrize("option", ["--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity",
                                    "--stall-check-warning-time-seconds",
                                    "--stall-check-shutdown-time-seconds"])
def test_negative_values_are_refused_at_launch(option):
    for args in ([option, "-1"], [f"{option}=-1"]):
        with pytest.raises(run.LaunchError, match=f"^{option} must be >= 0, got '-1'$"):
            _launch(args)


@pytest.mark.parametrize("value", ["nan", "inf", "lots"])
def test_values_that_are_not_finite_numbers_are_refused_at_launch(value):
    for option in ("--fusion-threshold-mb", "--cycle-time-ms",
                   "--stall-check-warning-time-seconds"):
        with pytest.raises(run.LaunchError, match=f"^{option} needs a number"):
            _launch([option, value])


def test_a_refused_value_stops_fusionrun_with_exit_code_2(tmp_path):
    done = _fusionrun("--cycle-time-ms", "-5", tmp_path=tmp_path)
    assert done.returncode == 2
    assert "fusionrun: --cycle-time-ms must be >= 0, got '-5'" in done.stderr


def test_a_long_option_may_be_shortened_to_a_prefix_of_one_option_as_in_horovodrun():
    assert _launch(["--fusion-threshold", "4"]).env_added["FUSIONRING_FUSION_THRESHOLD"] == str(4 << 20)
    assert _launch(["--cycle-time=2"]).env_added["FUSIONRING_CYCLE_TIME_MS"] == "2.0"
    with pytest.raises(run.LaunchError, match="--slots-per-host: elastic launches are not supported"):
        _launch(["--slots", "2"])
    with pytest.raises(run.LaunchError, match="ambiguous option: --timeline could match "
                                              "--timeline-filename, --timeline-mark-cycles"):
        _launch(["--timeline", "t.json"])
    # single-dash options are mpiexec's, passed on as they are
    assert "-ppn" in run.parse_args(["-np", "2", "-ppn", "1", "python", "t.py"]).mpiexec_options


def test_a_near_miss_of_an_option_is_refused_naming_the_option_meant():
    with pytest.raises(run.LaunchError, match=r"unknown option --fusion-threshold-mbb: did you mean "
                                              r"--fusion-threshold-mb\?"):
        run.parse_args(["-np", "2", "--fusion-threshold-mbb", "32", "python", "t.py"])
    with pytest.raises(run.LaunchError, match=r"did you mean --timeline-filename\?"):
        run.parse_args(["-np", "2", "--timeline-filenme=t.json", "python", "t.py"])
    # mpiexec's own options still pass, with one dash or two, and so does a near miss written
    # with one dash (the way to mean mpiexec's option of that name)
    for words in (["--bind-to", "core"], ["--oversubscribe"], ["--report-bindings"],
                  ["-fusion-threshold-mbb"], ["--print-rank-map"]):
        request = run.parse_args(["-np", "2", *words, "python", "t.py"])
        assert request.mpiexec_options == words and request.program == ["python", "t.py"]
