"""The emulated cluster: rate parsing, naming, and (as root with iproute2) a real shaped lab."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionring import cluster

REPO = Path(__file__).resolve().parents[1]
LAB_UNAVAILABLE = cluster.missing_prerequisites()
needs_lab = pytest.mark.skipif(LAB_UNAVAILABLE is not None, reason=LAB_UNAVAILABLE or "")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_module(module: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10).stdout


# ------------------------------------------------------------------------------- no root needed

@pytest.mark.parametrize("text, bits", [
    ("1gbit", 10**9), ("10gbit", 10**10), ("100mbit", 10**8), ("500kbit", 5 * 10**5),
    ("1.5Gbit", 15 * 10**8), ("2mibit", 2 * 2**20), ("1mbps", 8 * 10**6), ("64000", 64000),
    ("800bit", 800), ("1e9", 10**9),
])
def test_rates_are_parsed_as_tc_spells_them(text, bits):
    assert cluster.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "1gbat", "gbit", "-1gbit", "0mbit", "1 g bit", "1.2.3mbit"])
def test_garbage_rates_are_rejected_with_the_units_named(text):
    with pytest.raises(ValueError, match="invalid rate"):
        cluster.parse_rate(text)


def test_bucket_holds_two_milliseconds_and_at_least_64_kib():
    assert cluster.tbf_burst_bytes(cluster.parse_rate("100mbit")) == 64 * 1024
    assert cluster.tbf_burst_bytes(cluster.parse_rate("10gbit")) == 2_500_000


def test_ranks_are_named_addressed_and_prefixed_without_root():
    lab = cluster.Cluster(4, "1gbit")
    assert [lab.namespace(r) for r in range(4)] == ["fr0", "fr1", "fr2", "fr3"]
    assert lab.address(3) == "10.77.0.4"
    prefix = lab.rank_prefix(3)
    assert Path(prefix[0]).name == "ip" and prefix[1:] == ["netns", "exec", "fr3"]
    assert lab.mpi_env()["MPIR_CVAR_NOLOCAL"] == "1" and lab.mpi_env()["FI_PROVIDER"] == "tcp"
    with pytest.raises(ValueError):
        lab.namespace(4)
    with pytest.raises(ValueError):
        cluster.Cluster(0, "1gbit")
    with pytest.raises(ValueError, match="invalid rate"):
        cluster.Cluster(2, "quick")


def test_cli_rejects_a_bad_rate_before_touching_anything():
    done = _run_module("fusionring.cluster", "up", "2", "--rate", "lots")
    assert done.returncode == 2 and "invalid rate 'lots'" in done.stderr


def test_without_root_the_cli_says_why_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in cluster.missing_prerequisites()
    assert cluster.main(["up", "2", "--rate", "1gbit"]) == 2
    assert "needs root" in capsys.readouterr().err
    with pytest.raises(cluster.ClusterError, match="needs root"):
        cluster.Cluster(2, "1gbit").up()


def test_without_iproute2_the_cli_says_why_and_fails(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster, "_find_tool", lambda name: None)
    assert "iproute2" in cluster.missing_prerequisites()
    assert cluster.main(["down"]) == 2
    assert "iproute2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- a real lab

@pytest.fixture
def clean_lab():
    """No lab before the test, and none after it, whatever the test did."""
    cluster.teardown()
    try:
        yield
    finally:
        cluster.teardown()
        assert cluster.existing_namespaces() == []


@needs_lab
def test_up_shapes_both_directions_and_measures_close_to_the_configured_rate(clean_lab):
    lab = cluster.Cluster(2, "100mbit")
    measurement = lab.up(out=open(os.devnull, "w"))
    assert cluster.existing_namespaces() == ["fr0", "fr1"]
    assert 0.70 <= measurement.fraction_of_configured <= 1.05, measurement.describe()
    for qdiscs in (_ip("-n", "fr1", "-d", "link", "show", "eth0"), _ip("-d", "link", "show", "frv1")):
        assert "tbf" in qdiscs
    # the namespaces reach only the lab's /24: no default route anywhere
    routes = _ip("-n", "fr0", "route", "show")
    assert "default" not in routes and "10.77.0.0/24" in routes
    reverse = lab.measure(1, 0, seconds=0.5)
    assert 0.70 <= reverse.fraction_of_configured <= 1.05, reverse.describe()


@needs_lab
def test_up_replaces_an_existing_lab_and_down_is_idempotent(clean_lab):
    cluster.Cluster(3, "1gbit").up(verify=False, out=open(os.devnull, "w"))
    cluster.Cluster(2, "1gbit").up(verify=False, out=open(os.devnull, "w"))
    assert cluster.existing_namespaces() == ["fr0", "fr1"]
    first, second = _run_module("fusionring.cluster", "down"), _run_module("fusionring.cluster", "down")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "nothing to remove" in second.stdout
    assert cluster.existing_namespaces() == [] and "frbr0" not in _ip("-o", "link", "show")


@needs_lab
def test_down_removes_what_a_partial_up_left(clean_lab):
    subprocess.run(["ip", "netns", "add", "fr5"], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", "frbr0", "type", "bridge"], check=True, timeout=10)
    subprocess.run(["ip", "link", "add", "frv7", "type", "veth", "peer", "name", "frv7peer"], check=True,
                   timeout=10)
    removed = cluster.teardown()
    assert {"fr5", "frbr0", "frv7"} <= set(removed)
    assert cluster.existing_namespaces() == []
    assert not re.search(r"\b(frbr0|frv7|frv7peer)\b", _ip("-o", "link", "show"))


ALLREDUCE_BYTES = 8 << 20
ALLREDUCE = f"""
import os, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
x = np.full({ALLREDUCE_BYTES} // 4, comm.rank + 1, dtype=np.float32)
comm.Barrier()
start = time.perf_counter()
comm.Allreduce(MPI.IN_PLACE, x)
elapsed = time.perf_counter() - start
ok = bool((x == comm.size * (comm.size + 1) / 2).all())
os.write(1, f"rank {{comm.rank}} ok {{ok}} seconds {{elapsed:.3f}}\\n".encode())
"""


def _mpich_or_reason() -> str:
    from fusionring import launcher as run
    try:
        flavour = run.detect_flavour(run.find_mpiexec())
    except Exception as exc:  # no mpiexec at all
        return str(exc)
    return "" if flavour == run.MPICH else "fusionrun --cluster needs MPICH's mpiexec (Hydra)"


@needs_lab
def test_fusionrun_cluster_allreduces_over_the_shaped_links_and_removes_the_lab(clean_lab):
    if _mpich_or_reason():
        pytest.skip(_mpich_or_reason())
    rate = "100mbit"
    started = time.monotonic()
    done = _run_module("fusionring.launcher", "-np", "2", "--cluster", "2", "--rate", rate,
                       sys.executable, "-c", ALLREDUCE, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured" in done.stderr and "no latency is added" in done.stderr
    results = re.findall(r"rank (\d) ok (\w+) seconds ([0-9.]+)", done.stdout)
    assert sorted(rank for rank, _, _ in results) == ["0", "1"]
    assert all(ok == "True" for _, ok, _ in results)
    # with 2 ranks every rank must send at least the whole buffer's worth (2(N-1)/N of it)
    floor_s = ALLREDUCE_BYTES * 8 / cluster.parse_rate(rate)
    slowest = max(float(seconds) for _, _, seconds in results)
    assert slowest >= 0.9 * floor_s, f"{slowest:.3f} s beats the link's {floor_s:.3f} s: not over the lab"
    assert time.monotonic() - started < 50
    assert cluster.existing_namespaces() == []
    assert "frbr0" not in _ip("-o", "link", "show")
