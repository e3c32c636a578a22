"""The examples run as a user runs them: mpiexec, the script, its flags."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, mpiexec_path


@pytest.mark.parametrize("flags", [[], ["--fp16-allreduce"], ["--use-adasum"]])
def test_synthetic_benchmark_runs_and_ranks_end_equal(flags):
    cmd = [mpiexec_path(), "-n", "2", sys.executable, str(ROOT / "examples/synthetic_benchmark.py"),
           "--batch-size", "4", "--image-size", "16", "--num-warmup-batches", "1",
           "--num-batches-per-iter", "2", "--num-iters", "2", *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert len(re.findall(r"^Iter #\d: [\d.]+ img/sec per rank$", out, re.M)) == 2, out
    assert re.search(r"^Total img/sec on 2 ranks: [\d.]+ \+-[\d.]+$", out, re.M), out
    assert ("Adasum" in out) == ("--use-adasum" in flags)
    assert re.search(r"^Largest weight difference between ranks: 0$", out, re.M), out
