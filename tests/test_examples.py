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
    import torch
    if torch.cuda.device_count() < 2:  # a GPU per rank, or both ranks on the CPU
        cmd.append("--no-cuda")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert len(re.findall(r"^Iter #\d: [\d.]+ img/sec per rank$", out, re.M)) == 2, out
    assert re.search(r"^Total img/sec on 2 ranks: [\d.]+ \+-[\d.]+$", out, re.M), out
    assert ("Adasum" in out) == ("--use-adasum" in flags)
    assert re.search(r"^Largest weight difference between ranks: 0$", out, re.M), out


@pytest.mark.parametrize("flags", [["--sync", "bsp"], ["--sync", "adaptive", "--slow-delay-ms", "5", "--fp16"],
                                   ["--sync", "ssp", "--staleness", "2", "--servers", "2"]])
def test_train_ps_example_trains(flags):
    """examples/train_ps.py as its docstring runs it: worker 0 reports every epoch, learns, and
    pushes once per batch of its shard."""
    from fusionring.datasets import load_digits_split

    servers = int(flags[flags.index("--servers") + 1]) if "--servers" in flags else 1
    # Plain SGD on this MLP swings between epochs at a large step (0.84 then 0.66 under bsp at lr 0.2), so the
    # bar is set at a step that learns steadily, given epochs enough to get there.
    workers, epochs, batch = 2, 8, 32
    cmd = [mpiexec_path(), "-n", str(servers + workers), sys.executable, str(ROOT / "examples/train_ps.py"),
           "--epochs", str(epochs), "--batch-size", str(batch), "--lr", "0.1", *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    accuracies = [float(a) for a in re.findall(r"^epoch \d+: test accuracy ([\d.]+) after [\d.]+ s$", out, re.M)]
    assert len(accuracies) == epochs, out
    # Ten classes: chance is 0.1; a few epochs of SGD on digits get far past it.
    assert accuracies[-1] > 0.5, out
    shard = len(range(0, len(load_digits_split(0)[0][0]), workers))  # worker 0's rows
    pushes = epochs * -(-shard // batch)
    summary = re.search(r"^worker 0: (\d+) pushes, \d+ held back", out, re.M)
    assert summary and int(summary.group(1)) == pushes, out
