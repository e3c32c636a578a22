"""fusionrun: the command it builds for each MPI flavour, and real runs through the environment's mpiexec."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fusionring import launcher as run

REPO = Path(__file__).resolve().parents[1]

MPICH_VERSION = textwrap.dedent("""\
    HYDRA build details:
        Version:                                 4.1.2
        Process Manager:                         pmi
    """)
OPEN_MPI_VERSION = "mpirun (Open MPI) 4.1.5\n\nReport bugs to https://www.open-mpi.org/community/help/\n"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def fusionrun(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m fusionring.launcher ARGS`` from the checkout, with a timeout."""
    return subprocess.run([sys.executable, "-m", "fusionring.launcher", *args], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


@pytest.fixture
def fake_mpiexec(tmp_path):
    """Make a stand-in mpiexec: answers ``--version`` with the given text, else prints argv and env."""

    def make(version_text: str) -> str:
        path = tmp_path / "mpiexec"
        path.write_text(textwrap.dedent(f"""\
            #!{sys.executable}
            import json, os, sys
            if sys.argv[1:] == ["--version"]:
                sys.stdout.write({version_text!r})
                sys.exit(0)
            print(json.dumps({{"argv": sys.argv[1:], "env": {{k: v for k, v in os.environ.items()
                                                          if k.startswith(("OMPI_", "MPIR_", "FI_"))}}}}))
            sys.exit(int(os.environ.get("FAKE_MPIEXEC_EXIT", "0")))
            """))
        path.chmod(0o755)
        return str(path)

    return make


def _dry_run(mpiexec: str, *args: str) -> str:
    done = fusionrun("--mpiexec", mpiexec, "--dry-run", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# ------------------------------------------------------------------------------ flavour detection

@pytest.mark.parametrize("text, flavour", [
    (MPICH_VERSION, run.MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", run.MPICH),
    (OPEN_MPI_VERSION, run.OPEN_MPI),
    ("mpiexec (Open MPI) 5.0.11\n", run.OPEN_MPI),
    ("mpirun (OpenRTE) 1.10.7\n", run.OPEN_MPI),
    ("prterun (PRRTE) 3.0.6\n", run.OPEN_MPI),
    ("some other launcher 1.0\n", run.UNKNOWN),
])
def test_flavour_is_read_from_version_output(text, flavour):
    assert run.flavour_from_version(text) == flavour


def test_environment_mpiexec_is_found_beside_python_and_recognised():
    mpiexec = run.find_mpiexec()
    assert os.access(mpiexec, os.X_OK)
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        assert mpiexec == str(beside)
    assert run.detect_flavour(mpiexec) in (run.MPICH, run.OPEN_MPI)


def test_missing_mpiexec_is_a_clear_error(tmp_path, monkeypatch):
    done = fusionrun("--mpiexec", str(tmp_path / "nope"), "-np", "2", "python", "x.py")
    assert done.returncode == 2 and "not found" in done.stderr
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(run.LaunchError, match="no mpiexec found"):
        run.find_mpiexec()


# -------------------------------------------------------------------------------------- dry runs

def test_dry_run_for_mpich_is_plain_mpiexec(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    line = _dry_run(mpiexec, "-np", "2", "python", "train.py", "--lr", "0.1", "--name", "a b")
    assert shlex.split(line) == [mpiexec, "-n", "2", "python", "train.py", "--lr", "0.1", "--name", "a b"]


def test_dry_run_for_open_mpi_adds_oversubscribe_and_root_permission(fake_mpiexec):
    mpiexec = fake_mpiexec(OPEN_MPI_VERSION)
    words = shlex.split(_dry_run(mpiexec, "-np", "4", "python", "train.py"))
    if os.geteuid() == 0:
        assert words[:2] == ["OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"]
        assert words[2:] == [mpiexec, "--oversubscribe", "--allow-run-as-root", "-n", "4", "python", "train.py"]
    else:
        assert words == [mpiexec, "--oversubscribe", "-n", "4", "python", "train.py"]


def test_open_mpi_root_settings_depend_on_root_only():
    request = run.parse_args(["-np", "2", "python", "t.py"])
    as_root = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=True)
    as_user = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=False)
    assert as_root.env_added == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "--allow-run-as-root" in as_root.argv
    assert as_user.env_added == {} and "--allow-run-as-root" not in as_user.argv
    assert run.build_launch(request, "mpiexec", run.MPICH, running_as_root=True).env_added == {}


def test_unknown_options_pass_through_unchanged_before_the_program(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    words = shlex.split(_dry_run(mpiexec, "-np", "2", "-hosts", "localhost", "-genv", "A", "1",
                                 "-prepend-rank", "--map-by=core", "python", "t.py", "-hosts", "x"))
    assert words == [mpiexec, "-hosts", "localhost", "-genv", "A", "1", "-prepend-rank", "--map-by=core",
                     "-n", "2", "python", "t.py", "-hosts", "x"]


def test_double_dash_ends_the_options_and_later_ones_belong_to_the_program(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    words = shlex.split(_dry_run(mpiexec, "-np", "2", "-prepend-rank", "--", "python", "t.py", "--", "-np", "9"))
    assert words == [mpiexec, "-prepend-rank", "-n", "2", "python", "t.py", "--", "-np", "9"]


def test_slow_rank_gets_the_slowdown_env_and_no_other_rank_does(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    words = shlex.split(_dry_run(mpiexec, "-np", "4", "--slow", "1:3", "python", "t.py"))
    segments = " ".join(words[1:]).split(" : ")
    assert segments == ["-n 1 python t.py", "-n 1 env FUSIONRING_SLOWDOWN=3 python t.py", "-n 2 python t.py"]


def test_cluster_dry_run_starts_each_rank_in_its_namespace_over_tcp(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpiexec, "--dry-run", "--cluster", "2", "--rate", "100mbit",
                     "--slow", "1:2", "python", "t.py")
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout.strip())
    env = dict(word.split("=", 1) for word in words[:5])
    assert env == {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                   "FI_TCP_IFACE": "eth0", "FUSIONRING_SHARED_MEMORY": "off"}
    segments = " ".join(words[6:]).split(" : ")
    assert len(segments) == 2
    assert segments[0].endswith("netns exec fr0 python t.py") and segments[0].startswith("-n 1 ")
    assert segments[1].endswith("netns exec fr1 env FUSIONRING_SLOWDOWN=2 python t.py")
    assert "up 2 --rate 100mbit" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["-np", "3", "--cluster", "2", "python", "t.py"], "must equal -np"),
    (["-np", "2", "--cluster", "2", "--rate", "fast", "python", "t.py"], "invalid rate"),
    (["-np", "2", "--rate", "1gbit", "python", "t.py"], "only applies with --cluster"),
    (["-np", "2", "--slow", "2:3", "python", "t.py"], "does not exist"),
    (["-np", "2", "--slow", "1:0", "python", "t.py"], "RANK:FACTOR"),
    (["-np", "2"], "no program"),
    (["python", "t.py"], "-np N is required"),
])
def test_bad_command_lines_exit_2_with_the_reason(fake_mpiexec, args, message):
    done = fusionrun("--mpiexec", fake_mpiexec(MPICH_VERSION), "--dry-run", *args)
    assert done.returncode == 2
    assert message in done.stderr


def test_cluster_is_refused_for_open_mpi(fake_mpiexec):
    done = fusionrun("--mpiexec", fake_mpiexec(OPEN_MPI_VERSION), "--dry-run", "--cluster", "2",
                     "python", "t.py")
    assert done.returncode == 2 and "needs MPICH" in done.stderr


def test_run_executes_the_dry_run_command_with_its_env(fake_mpiexec):
    mpiexec = fake_mpiexec(OPEN_MPI_VERSION)
    args = ["-np", "2", "--slow", "0:1.5", "-x", "A=1", "python", "t.py"]
    printed = shlex.split(_dry_run(mpiexec, *args))
    done = fusionrun("--mpiexec", mpiexec, *args)
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout)
    at = printed.index(mpiexec)
    assert ran["argv"] == printed[at + 1:]
    for assignment in printed[:at]:
        name, value = assignment.split("=", 1)
        assert ran["env"][name] == value


# ------------------------------------------------------------------------------------- real runs

# one write per line: mpiexec forwards each rank's output in the pieces the rank wrote it in
REPORT_RANK = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
               "line = f'rank {c.rank} of {c.size} sum {c.allreduce(c.rank + 1)} "
               "slowdown {os.environ.get(\"FUSIONRING_SLOWDOWN\", \"-\")}\\n'; "
               "os.write(1, line.encode())")


def test_two_ranks_run_and_allreduce_through_the_environment_mpiexec():
    done = fusionrun("-np", "2", sys.executable, "-c", REPORT_RANK)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 2 sum 3 slowdown -", "rank 1 of 2 sum 3 slowdown -"]


def test_slowdown_reaches_only_the_named_rank_in_a_real_run():
    done = fusionrun("-np", "3", "--slow", "1:3", sys.executable, "-c", REPORT_RANK)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert lines == ["rank 0 of 3 sum 6 slowdown -", "rank 1 of 3 sum 6 slowdown 3",
                     "rank 2 of 3 sum 6 slowdown -"]


def test_exit_code_of_the_job_is_the_exit_code_of_fusionrun():
    program = "from mpi4py import MPI; import sys; MPI.COMM_WORLD.Barrier(); sys.exit(3)"
    done = fusionrun("-np", "2", sys.executable, "-c", program)
    assert done.returncode == 3, done.stderr


KILL_RANK_ONE = (
    "import os, signal, time, torch; import fusionring.torch as hvd; hvd.init(); "
    "os.write(1, f'rank {hvd.rank()} pid {os.getpid()}\\n'.encode()); hvd.barrier(); "
    "(os.kill(os.getpid(), signal.SIGKILL) if hvd.rank() == 1 else None); "
    "[hvd.allreduce(torch.ones(4), name='x') for _ in range(1000)]")


def _names_each_ranks_process_id(program: str) -> None:
    """`program` prints 'rank R pid P' on 3 ranks, then one of them is killed."""
    done = fusionrun("-np", "3", sys.executable, "-c", program, timeout=120)
    assert done.returncode != 0
    pids = dict(line.split()[1:4:2] for line in done.stdout.splitlines()
                if line.startswith("rank ") and " pid " in line)
    assert sorted(pids) == ["0", "1", "2"], done.stdout
    summary = [line for line in done.stderr.splitlines() if "process ids" in line]
    assert len(summary) == 1, done.stderr
    for rank, pid in pids.items():
        assert f"rank {rank} = pid {pid} on " in summary[0]


def test_a_failed_job_names_each_ranks_process_id():
    """MPICH's launcher names a dead process by its id only; fusionrun says which rank it was."""
    _names_each_ranks_process_id(KILL_RANK_ONE)


KILL_A_WORKER = (
    "import os, signal, time, torch; from mpi4py import MPI; from fusionring import ps; "
    "os.write(1, f'rank {MPI.COMM_WORLD.Get_rank()} pid {os.getpid()}\\n'.encode()); "
    "ps.init(num_servers=1); m = torch.nn.Linear(2, 1); "
    "opt = ps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
    "named_parameters=m.named_parameters(), sync='asp'); "
    "(os.kill(os.getpid(), signal.SIGKILL) if ps.worker_rank() == 1 else time.sleep(60))")


def test_a_failed_parameter_server_job_names_each_ranks_process_id():
    _names_each_ranks_process_id(KILL_A_WORKER)


def test_exit_code_of_a_fake_mpiexec_is_passed_on(fake_mpiexec):
    mpiexec = fake_mpiexec(MPICH_VERSION)
    env = _env()
    env["FAKE_MPIEXEC_EXIT"] = "7"
    done = subprocess.run([sys.executable, "-m", "fusionring.launcher", "--mpiexec", mpiexec, "-np", "1", "true"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7


INIT_AND_REPORT = ("import fusionring.torch as hvd; hvd.init(); "
                   "print('size', hvd.size(), flush=True)")


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_a_process_that_a_launcher_counts_as_one_of_many_refuses_a_world_of_one(variable):
    env = _env()
    env[variable] = "3"
    done = subprocess.run([sys.executable, "-c", INIT_AND_REPORT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{variable}=3" in done.stderr and "fusionrun -np 3" in done.stderr, done.stderr
    assert "size" not in done.stdout


def test_a_launcher_that_counts_one_process_is_fine():
    env = _env()
    env["WORLD_SIZE"] = "1"
    done = subprocess.run([sys.executable, "-c", INIT_AND_REPORT], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["size", "1"]


def test_torchrun_fails_with_the_launch_hint_instead_of_lone_training(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(INIT_AND_REPORT.replace("; ", "\n"))
    torchrun = Path(sys.executable).with_name("torchrun")
    command = ([str(torchrun)] if torchrun.exists() else
               [sys.executable, "-m", "torch.distributed.run"])
    done = subprocess.run(command + ["--nproc_per_node", "2", "--master_port", "0", str(script)],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # Each process raises by itself (the test above); torchrun stops the other one as soon
    # as the first fails, so one or two messages come through.
    assert "WORLD_SIZE=2: this process was started as one of 2" in done.stderr, done.stderr
    assert "size" not in done.stdout


# ------------------------------------------------------------------------ horovodrun's options

def test_horovodrun_hosts_become_each_mpis_own_host_list(fake_mpiexec):
    mpich = fake_mpiexec(MPICH_VERSION)
    words = shlex.split(_dry_run(mpich, "-np", "4", "-H", "a:2,b:2", "python", "t.py"))
    assert words == [mpich, "-hosts", "a:2,b:2", "-n", "4", "python", "t.py"]
    words = shlex.split(_dry_run(mpich, "-np", "4", "--hosts=a:2, b", "python", "t.py"))
    assert words == [mpich, "-hosts", "a:2,b", "-n", "4", "python", "t.py"]
    request = run.parse_args(["-np", "4", "-H", "a:2,b:2", "python", "t.py"])
    environ = {"PYTHONPATH": "/src", "HOROVOD_FUSION_THRESHOLD": "0", "OLDPWD": "/",
               "BASH_FUNC_f%%": "() { :; }"}
    launch = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=False,
                              environ=environ)
    # Like horovodrun, the launching shell's environment reaches the other hosts' ranks.
    assert launch.argv == ["mpiexec", "--oversubscribe", "-H", "a:2,b:2",
                           "-x", "HOROVOD_FUSION_THRESHOLD", "-x", "PYTHONPATH",
                           "-n", "4", "python", "t.py"]
    one_host = run.build_launch(run.parse_args(["-np", "4", "python", "t.py"]), "mpiexec",
                                run.OPEN_MPI, running_as_root=False, environ=environ)
    assert "-x" not in one_host.argv  # local ranks inherit it


def test_horovodrun_hostfile_is_read_in_either_format(fake_mpiexec, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the nodes\nnode1 slots=4\n\nnode2:2\nnode3  # one slot\n")
    mpich = fake_mpiexec(MPICH_VERSION)
    words = shlex.split(_dry_run(mpich, "-np", "7", "--hostfile", str(hostfile), "python", "t.py"))
    assert words == [mpich, "-hosts", "node1:4,node2:2,node3", "-n", "7", "python", "t.py"]
    request = run.parse_args(["-np", "7", "--hostfile", str(hostfile), "python", "t.py"])
    launch = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=False, environ={})
    assert launch.argv[2:4] == ["--hostfile", str(hostfile)]


def test_horovodrun_tuning_options_reach_every_rank_in_fusionrings_units(fake_mpiexec):
    args = ["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
            "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles", "--no-stall-check",
            "python", "t.py"]
    expected = {"FUSIONRING_FUSION_THRESHOLD": str(32 * 1024 * 1024),
                "FUSIONRING_CYCLE_TIME_MS": "2.5", "FUSIONRING_TIMELINE": "/tmp/tl.json",
                "FUSIONRING_TIMELINE_MARK_CYCLES": "1",
                "FUSIONRING_STALL_WARNING_S": "0", "FUSIONRING_STALL_SHUTDOWN_S": "0"}
    request = run.parse_args(args)
    mpich = run.build_launch(request, "mpiexec", run.MPICH, running_as_root=False)
    assert mpich.env_added == expected
    assert mpich.argv == ["mpiexec", "-n", "2", "python", "t.py"]
    ompi = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=False)
    exported = [ompi.argv[i + 1] for i, word in enumerate(ompi.argv) if word == "-x"]
    assert sorted(exported) == sorted(expected)
    # The values are what fusionring's settings read back.
    from fusionring.config import _from_environment
    old = dict(os.environ)
    try:
        os.environ.update(expected)
        settings = _from_environment()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert settings.fusion_threshold_bytes == 32 * 1024 * 1024
    assert settings.cycle_time_ms == 2.5 and settings.timeline_path == "/tmp/tl.json"
    assert settings.timeline_mark_cycles
    assert settings.stall_warning_s is None and settings.stall_shutdown_s is None


@pytest.mark.parametrize("args, message", [
    (["-np", "2", "-H", "a:0", "python", "t.py"], "SLOTS > 0"),
    (["-np", "2", "-H", "", "python", "t.py"], "HOST:SLOTS"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "python", "t.py"], "--hostfile"),
    (["-np", "2", "--fusion-threshold-mb", "lots", "python", "t.py"], "needs a number"),
    (["-np", "2", "--cluster", "2", "-H", "a:2", "python", "t.py"], "drop -H"),
])
def test_bad_horovodrun_options_exit_2_with_the_reason(fake_mpiexec, args, message):
    done = fusionrun("--mpiexec", fake_mpiexec(MPICH_VERSION), "--dry-run", *args)
    assert done.returncode == 2
    assert message in done.stderr


def test_a_horovodrun_line_runs_with_the_environment_mpiexec(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import os, sys, fusionring.torch as hvd\nhvd.init()\n"
                      "open(os.path.join(sys.argv[1], f'rank{hvd.rank()}'), 'w').write("
                      "f\"{hvd.size()} {os.environ['FUSIONRING_CYCLE_TIME_MS']}\")\n")
    done = fusionrun("-np", "2", "-H", "localhost:2", "--cycle-time-ms", "3", sys.executable,
                     str(script), str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2 3.0", "2 3.0"]


def test_horovodrun_launch_options_in_each_mpis_words(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["-np", "2", "--network-interface", "eth1", "--network-interfaces=eth2,eth1", "-p", "2222",
            "-i", "/keys/id", "--output-filename", str(tmp_path / "logs"), "--tcp",
            "--mpi-args=-genv A 1", "--binding-args", "-bind-to core", "python", "t.py"]
    request = run.parse_args(args)
    mpich = run.build_launch(request, "mpiexec", run.MPICH, running_as_root=False)
    wrapper = str(tmp_path / "cache" / "fusionring" / Path(mpich.argv[4]).name)
    logs = str(tmp_path / "logs")
    assert mpich.argv == ["mpiexec", "-launcher", "ssh", "-launcher-exec", wrapper, "-iface", "eth1",
                          "-outfile-pattern", f"{logs}/rank.%r/stdout",
                          "-errfile-pattern", f"{logs}/rank.%r/stderr",
                          "-genv", "A", "1", "-bind-to", "core", "-n", "2", "python", "t.py"]
    assert mpich.env_added == {"FI_TCP_IFACE": "eth1", "UCX_NET_DEVICES": "eth1,eth2",
                               "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                               "NCCL_SOCKET_IFNAME": "eth1,eth2", "GLOO_SOCKET_IFNAME": "eth1"}
    assert mpich.dirs == [f"{logs}/rank.0", f"{logs}/rank.1"]
    assert mpich.files[wrapper] == '#!/bin/sh\nexec ssh -p 2222 -i /keys/id "$@"\n'
    ompi = run.build_launch(request, "mpiexec", run.OPEN_MPI, running_as_root=False)
    assert ompi.argv[:ompi.argv.index("-genv")] == [
        "mpiexec", "--oversubscribe", "--mca", "plm_rsh_args", "-p 2222 -i /keys/id",
        "--mca", "btl_tcp_if_include", "eth1,eth2", "--mca", "pml", "ob1", "--mca", "btl",
        "^openib,uct,ofi", "--output-filename", logs]
    exported = [ompi.argv[i + 1] for i, word in enumerate(ompi.argv) if word == "-x"]
    assert sorted(exported) == ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
    assert ompi.files == {} and ompi.dirs == []


def test_the_ssh_wrapper_hands_port_and_identity_to_ssh(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    request = run.parse_args(["-np", "2", "--ssh-port", "2200", "--ssh-identity-file", "/k/my key",
                              "python", "t.py"])
    launch = run.build_launch(request, "mpiexec", run.MPICH, running_as_root=False)
    launch.prepare()
    wrapper = launch.argv[launch.argv.index("-launcher-exec") + 1]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!{sys.executable}\nimport json, sys\n"
                              f"open({str(tmp_path / 'ssh.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    (fake / "ssh").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    subprocess.run([wrapper, "-x", "node7", "hydra_pmi_proxy --a 'b c'"], env=env, check=True, timeout=30)
    assert json.loads((tmp_path / "ssh.json").read_text()) == [
        "-p", "2200", "-i", "/k/my key", "-x", "node7", "hydra_pmi_proxy --a 'b c'"]


@pytest.mark.parametrize("option, note", [
    (["--autotune", "--autotune-log-file", "t.csv"], "has no autotuner"),
    (["--hierarchical-allreduce"], "no hierarchical mode"),
    (["--start-timeout", "30"], "no checks of its own"),
    (["--log-level", "DEBUG"], "no log levels"),
    (["--num-nccl-streams", "2"], "one CUDA stream per process set"),
    (["--mpi", "--log-without-timestamp", "--stall-check"], None),
    # horovodrun's --disable-cache only stops it caching its own start-up checks
    (["--disable-cache"], None),
])
def test_horovodrun_options_for_parts_fusionring_lacks_run_with_a_note(fake_mpiexec, option, note):
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "--dry-run", "-np", "2", *option, "python", "t.py")
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout.strip()) == [mpich, "-n", "2", "python", "t.py"]
    if note is None:
        assert done.stderr == ""
    else:
        assert f"fusionrun: ignoring horovodrun's {option[0]}: " in done.stderr and note in done.stderr


@pytest.mark.parametrize("option, variable", [
    (["--cache-capacity", "512"], "FUSIONRING_CACHE_CAPACITY=512"),
])
def test_horovodrun_cache_options_size_the_negotiation_cache(fake_mpiexec, option, variable):
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "--dry-run", "-np", "2", *option, "python", "t.py")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert shlex.split(done.stdout.strip()) == [variable, mpich, "-n", "2", "python", "t.py"]


@pytest.mark.parametrize("option, message", [
    (["--gloo"], "MPI processes started by mpiexec"),
    (["--cache-capacity", "-1"], "--cache-capacity must be >= 0, got '-1'"),
    (["--jsrun"], "drop --jsrun"),
    (["--min-np", "2", "--max-np", "4"], "elastic launches are not supported"),
    (["--host-discovery-script", "d.sh"], "elastic launches are not supported"),
    (["-p", "ssh"], "needs a port number"),
    (["--network-interface", ","], "needs a network interface name"),
])
def test_horovodrun_options_whose_meaning_cannot_be_kept_stop_the_launch(fake_mpiexec, option, message):
    done = fusionrun("--mpiexec", fake_mpiexec(MPICH_VERSION), "--dry-run", "-np", "2", *option,
                     "python", "t.py")
    assert done.returncode == 2 and message in done.stderr, done.stderr


HOROVOD_CONFIG = """\
controller: mpi
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
autotune:
  enabled: true
  log_file: autotune.csv
  warmup_samples: 5
timeline:
  filename: timeline.json
  mark_cycles: true
stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240
library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
logging:
  level: INFO
  hide_timestamp: true
"""


def test_a_horovodrun_config_file_sets_what_its_options_would(fake_mpiexec, tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text(HOROVOD_CONFIG)
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "--dry-run", "--config-file", str(config), "-np", "2",
                     "python", "t.py")
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout.strip())
    assert words == ["FUSIONRING_FUSION_THRESHOLD=33554432", "FUSIONRING_CYCLE_TIME_MS=10.0",
                     "FUSIONRING_CACHE_CAPACITY=2048", "FUSIONRING_TIMELINE=timeline.json", "FUSIONRING_TIMELINE_MARK_CYCLES=1",
                     "FUSIONRING_STALL_WARNING_S=120.0", "FUSIONRING_STALL_SHUTDOWN_S=240.0",
                     mpich, "-n", "2", "python", "t.py"]
    # One note per setting that changes nothing, in the file's own words; none for false
    # switches, autotuning's own settings or hide_timestamp.
    notes = [line.split(": ", 1)[1] for line in done.stderr.splitlines()]
    assert [note.split(" in ")[0] for note in notes] == [
        "ignoring params.hierarchical_allreduce",
        "ignoring autotune.enabled", "ignoring library_options.mpi_threads_disable",
        "ignoring library_options.num_nccl_streams", "ignoring logging.level"]
    assert all(f" in {config}: " in note for note in notes)


def test_the_command_line_overrides_the_config_file(fake_mpiexec, tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text("params:\n  cycle_time_ms: 10\n  fusion_threshold_mb: 8\n"
                      "stall_check:\n  enabled: false\n  warning_time_seconds: 5\n"
                      "extra:\n  a: 1\ntimeline:\n  typo: 1\n")
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "--dry-run", "-np", "2", "--cycle-time-ms", "3",
                     f"--config-file={config}", "python", "t.py")
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout.strip())[:4] == [
        "FUSIONRING_CYCLE_TIME_MS=3.0", "FUSIONRING_FUSION_THRESHOLD=8388608",
        "FUSIONRING_STALL_WARNING_S=0", "FUSIONRING_STALL_SHUTDOWN_S=0"]
    assert f"ignoring extra in {config}: horovodrun has no such section" in done.stderr
    assert f"ignoring timeline.typo in {config}: horovodrun has no such setting" in done.stderr


@pytest.mark.parametrize("text, message", [
    ("controller: gloo\n", "set controller: mpi"),
    ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: expected a number >= 0, got 'fast'"),
    ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb: expected a number >= 0"),
    ("timeline:\n  mark_cycles: sometimes\n", "timeline.mark_cycles: expected true or false"),
    ("params: [1, 2]\n", "params: expected keys under it"),
    ("- a\n", "expected sections"),
    ("params: {a: [\n", "is not valid YAML"),
])
def test_a_config_file_that_cannot_be_used_stops_the_launch(fake_mpiexec, tmp_path, text, message):
    config = tmp_path / "hvd.yaml"
    config.write_text(text)
    done = fusionrun("--mpiexec", fake_mpiexec(MPICH_VERSION), "--dry-run", "-np", "2",
                     "--config-file", str(config), "python", "t.py")
    assert done.returncode == 2 and message in done.stderr and str(config) in done.stderr, done.stderr
    missing = fusionrun("--mpiexec", fake_mpiexec(MPICH_VERSION), "--dry-run", "-np", "2",
                        "--config-file", str(tmp_path / "none.yaml"), "python", "t.py")
    assert missing.returncode == 2 and "No such file" in missing.stderr


def test_check_build_and_version_report_and_exit():
    done = fusionrun("--check-build")
    assert done.returncode == 0
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert "[X] PyTorch" in lines and "[X] MPI" in lines and "[ ] Gloo" in lines
    assert "[ ] NCCL" in lines
    from fusionring import __version__
    assert fusionrun("-v").stdout.strip() == f"fusionrun (fusionring {__version__})"


def test_horovodrun_launch_options_in_a_real_run(tmp_path):
    # --tcp makes MPICH use libfabric's TCP provider, which fails MPI_Finalize if the
    # shared-memory window of 2 ranks on 2+ cores were still allocated at exit.
    if run.detect_flavour(run.find_mpiexec()) != run.MPICH:
        pytest.skip("checks MPICH's words: its output layout and its libfabric transport")
    script = tmp_path / "t.py"
    script.write_text("import sys, torch, fusionring.torch as hvd\nhvd.init()\n"
                      "print('sum', hvd.allreduce(torch.ones(4), op=hvd.Sum).tolist())\n"
                      "print('rank', hvd.rank(), file=sys.stderr)\n")
    logs = tmp_path / "logs"
    done = fusionrun("-np", "2", "--network-interface", "lo", "--tcp", "--output-filename", str(logs),
                     "--verbose", sys.executable, str(script), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fusionrun: " in done.stderr and "-outfile-pattern" in done.stderr  # --verbose
    for rank in range(2):
        assert (logs / f"rank.{rank}" / "stdout").read_text() == "sum [2.0, 2.0, 2.0, 2.0]\n"
        assert f"rank {rank}" in (logs / f"rank.{rank}" / "stderr").read_text()


@pytest.mark.parametrize("option", [["--timeline-filename", "--dry-run"], ["--log-level", "--dry-run"],
                                    ["-np", "--verbose"], ["--autotune-log-file", "-x"]])
def test_an_option_where_a_value_belongs_is_refused_as_horovodrun_refuses_it(fake_mpiexec, option):
    """Taken as the value, `--timeline-filename --dry-run` ran the job and wrote a timeline named
    '--dry-run'."""
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "-np", "2", *option, "python", "t.py")
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert f"{option[0]} expected a value, got the option {option[1]!r}" in done.stderr, done.stderr


def test_values_that_start_with_a_dash_but_are_values_are_taken(fake_mpiexec):
    mpich = fake_mpiexec(MPICH_VERSION)
    done = fusionrun("--mpiexec", mpich, "--dry-run", "-np", "2", "--mpi-args", "-genv A 1",
                     "--timeline-filename=-odd.json", "python", "t.py")
    assert done.returncode == 0, done.stderr
    assert "FUSIONRING_TIMELINE=-odd.json" in done.stdout and "-genv A 1" in done.stdout, done.stdout
    negative = fusionrun("--mpiexec", mpich, "--dry-run", "-np", "2", "--cycle-time-ms", "-1",
                         "python", "t.py")
    assert negative.returncode == 2 and "expected a value" not in negative.stderr, negative.stderr
