"""Shared test helpers: the one way multi-rank tests launch mpiexec."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Prepended to every rank script: a way to hand a JSON-able result back to the test.
_PRELUDE = '''
import json as _json, os as _os
def report(value):
    from mpi4py import MPI as _MPI
    _path = _os.path.join(_os.environ["FR_TEST_OUT"], "rank%d.json" % _MPI.COMM_WORLD.Get_rank())
    with open(_path, "w") as _f:
        _json.dump(value, _f)
'''


# Open MPI's mpiexec refuses root and more ranks than cores unless told (fusionrun tells it; these
# tests call mpiexec directly). MPICH ignores the variables.
for _name, _value in (("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
                      ("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe"),
                      ("OMPI_MCA_rmaps_base_oversubscribe", "1")):
    os.environ.setdefault(_name, _value)


def mpiexec_path() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec found")
    return found


class RanksFailed(AssertionError):
    pass


def run_ranks(np: int, code: str, tmp_path: Path, *, timeout: float = 90,
              env: Optional[Dict[str, str]] = None, expect_failure: bool = False) -> List:
    """Run `code` on `np` ranks under mpiexec; return each rank's `report(...)` value.

    A hang fails the test after `timeout` seconds instead of blocking the suite. With
    `expect_failure`, a nonzero exit is allowed and the combined output is returned too.
    """
    out = tmp_path / f"ranks{np}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    script = tmp_path / f"script_{np}.py"
    script.write_text(_PRELUDE + textwrap.dedent(code))
    full_env = dict(os.environ)
    full_env.update({"FR_TEST_OUT": str(out), "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    cmd = [mpiexec_path(), "-n", str(np), sys.executable, str(script)]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout,
                              cwd=str(tmp_path))
    except subprocess.TimeoutExpired as exc:
        raise RanksFailed(f"{np}-rank run timed out after {timeout}s (a hang)\n"
                          f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}") from None
    results = []
    for r in range(np):
        path = out / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    if expect_failure:
        return results, proc.returncode, proc.stdout + proc.stderr
    if proc.returncode != 0 or any(r is None for r in results):
        raise RanksFailed(f"{np}-rank run failed (exit {proc.returncode})\n"
                          f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return results
