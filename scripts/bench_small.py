"""An ordinary Horovod-style script on a small model, timed: fusionring trees against each
other and against Horovod when it is importable.

The script: an MLP of about 120K parameters on scikit-learn's digits, batch 32 per rank,
20 epochs, SGD with momentum, the default ``DistributedOptimizer``, launched with plain
``mpiexec``. Contenders run interleaved, ``--runs`` times at each rank count; the table
gives the median training time, each contender's ratio to the first, and the CPU seconds the
ranks' training threads and their other threads (the library's background threads, MPI's)
spent in the timed loop, summed over the ranks.

    python scripts/bench_small.py -np 2,3,4 --runs 5 --tree . --tree ../before \
        --output docs/benchmarks/small-cpu.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(library: str, epochs: int) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    if library == "horovod":
        import horovod.torch as hvd
    else:
        import fusionring.torch as hvd
    from sklearn.datasets import load_digits

    hvd.init()
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    hvd.allreduce(torch.zeros(1), name="start")
    import threading
    import psutil
    me = psutil.Process()
    training = threading.get_native_id()
    cpu_before = {t.id: t.user_time + t.system_time for t in me.threads()}
    start = time.perf_counter()
    for _ in range(epochs):
        for i in range(0, len(x), 32):
            opt.zero_grad()
            F.cross_entropy(model(x[i:i + 32]), y[i:i + 32]).backward()
            opt.step()
    hvd.allreduce(torch.zeros(1), name="end")
    wall = time.perf_counter() - start
    # CPU seconds of this rank's training thread and of all its other threads (the library's
    # background threads, MPI's), over the timed loop.
    cpu = {t.id: t.user_time + t.system_time - cpu_before.get(t.id, 0.0) for t in me.threads()}
    main_cpu = cpu.pop(training, 0.0)
    gathered = hvd.allgather_object((main_cpu, sum(cpu.values())))
    if hvd.rank() == 0:
        train_cpu = sum(m for m, _ in gathered)
        other_cpu = sum(o for _, o in gathered)
        steps = epochs * len(range(0, len(x), 32))
        print(f"TIME {wall:.4f} {train_cpu:.4f} {other_cpu:.4f} {steps}", flush=True)


def run(contender: tuple, np: int, epochs: int, mpiexec: str) -> tuple:
    """(training seconds, CPU seconds of the training threads, CPU seconds of all other
    threads, steps per rank), the CPU summed over the ranks."""
    library, tree = contender
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [mpiexec, "-n", str(np), sys.executable, str(Path(__file__).resolve()),
           "--worker", library, "--epochs", str(epochs)]
    out = subprocess.run(cmd, env=env, check=True, timeout=600, capture_output=True, text=True,
                         cwd=str(tree or ROOT)).stdout
    line = next(line for line in out.splitlines() if line.startswith("TIME"))
    return tuple(float(v) for v in line.split()[1:5])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", default="2,3,4")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--tree", action="append", type=Path,
                        help="a fusionring checkout to time (repeatable; default: this one)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.epochs)
        return
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    contenders = [("fusionring", t.resolve()) for t in (args.tree or [ROOT])]
    has_horovod = importlib.util.find_spec("horovod") is not None
    if has_horovod:
        contenders.append(("horovod", None))
    label = {c: (c[0] if c[1] is None else f"fusionring ({c[1].name})") for c in contenders}
    counts = [int(n) for n in args.np.split(",")]
    load = os.getloadavg()[0]
    times: dict = {}
    for _ in range(args.runs):
        for np in counts:
            for c in contenders:
                times.setdefault((np, c), []).append(run(c, np, args.epochs, mpiexec))
    load_after = os.getloadavg()[0]
    lines = ["| ranks | contender | median s | ratio to the first | runs (s) "
             "| CPU s, training threads | CPU s, other threads | other threads, ms per step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for np in counts:
        first = statistics.median(t for t, *_ in times[(np, contenders[0])])
        for c in contenders:
            med = statistics.median(t for t, *_ in times[(np, c)])
            train = statistics.median(r[1] for r in times[(np, c)])
            other = statistics.median(r[2] for r in times[(np, c)])
            runs = ", ".join(f"{t:.2f}" for t, *_ in times[(np, c)])
            steps = times[(np, c)][0][3]
            lines.append(f"| {np} | {label[c]} | {med:.2f} | {med / first:.2f} | {runs} | "
                         f"{train:.2f} | {other:.2f} | {1000 * other / np / steps:.3f} |")
    table = "\n".join(lines)
    note = "" if has_horovod else "\nHorovod is not importable in this environment: not run.\n"
    print(table + "\n" + note + f"load average {load:.2f} before, {load_after:.2f} after")
    if args.output:
        command = "python scripts/bench_small.py " + " ".join(sys.argv[1:])
        args.output.write_text(
            "# A small Horovod-style script on a shared CPU\n\n"
            f"Command: `{command}`\n\n{os.cpu_count()} cores; load average {load:.2f} before, "
            f"{load_after:.2f} after.\n\n{table}\n{note}")


if __name__ == "__main__":
    main()
