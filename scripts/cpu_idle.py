"""What the runtime costs while it waits: CPU per rank, read from per-thread counters.

Two cases, each in its own ``mpiexec`` run:
- idle: every rank initialised, nothing submitted, for ``--seconds``;
- blocked: rank 0 waits in a 4 KiB allreduce for rank 1, which submits ``--seconds`` late
  (the other ranks wait with rank 0).

The figure is the CPU time of the process's threads over the wall time of the window, in
percent of one core; the runtime's own thread (``fusionring-loop``) is shown apart. Trees
given with ``--tree`` (a checkout's root, put first on ``PYTHONPATH``) run interleaved, so
a before/after comparison shares the machine's load.

    python scripts/cpu_idle.py -np 2,4 --rounds 3 --tree . --tree ../other-checkout \
        --output docs/benchmarks/cpu-idle.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(mode: str, seconds: float, out: str) -> None:
    import threading

    import psutil
    import torch

    import fusionring.torch as hvd

    hvd.init()
    time.sleep(1.0)  # past init's own work
    proc = psutil.Process()

    def snapshot():
        return {t.id: t.user_time + t.system_time for t in proc.threads()}

    before, start = snapshot(), time.monotonic()
    if mode == "idle":
        time.sleep(seconds)
    else:
        if hvd.rank() == 1:
            time.sleep(seconds)
        hvd.allreduce(torch.ones(1024), name="late")
    after, wall = snapshot(), time.monotonic() - start
    names = {t.native_id: t.name for t in threading.enumerate()}
    total = sum(after[k] - before.get(k, 0.0) for k in after) / wall * 100
    loop = sum(after[k] - before.get(k, 0.0) for k in after
               if names.get(k) == "fusionring-loop") / wall * 100
    Path(out, f"rank{hvd.rank()}.json").write_text(json.dumps({"total": total, "loop": loop}))
    hvd.shutdown()


def run(tree: Path, np: int, mode: str, seconds: float, mpiexec: str) -> list:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [mpiexec, "-n", str(np), sys.executable, str(Path(__file__).resolve()),
               "--worker", mode, "--seconds", str(seconds), "--out", out]
        subprocess.run(cmd, env=env, check=True, timeout=seconds + 120, cwd=str(tree),
                       stdout=subprocess.DEVNULL)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(np)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", default="2,4", help="rank counts, comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tree", action="append", type=Path,
                        help="a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--output", type=Path, help="write a Markdown report here")
    parser.add_argument("--worker", choices=["idle", "blocked"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.seconds, args.out)
        return
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    counts = [int(n) for n in args.np.split(",")]
    load = os.getloadavg()[0]
    # (tree, np, mode) -> per round: (max over ranks of total, max loop, rank 0 total)
    got: dict = {}
    for _ in range(args.rounds):
        for np in counts:
            for mode in ("idle", "blocked"):
                for tree in trees:
                    ranks = run(tree, np, mode, args.seconds, mpiexec)
                    got.setdefault((tree, np, mode), []).append(
                        (max(r["total"] for r in ranks), max(r["loop"] for r in ranks),
                         ranks[0]["total"]))
    load_after = os.getloadavg()[0]
    lines = ["| tree | ranks | case | busiest rank, median % of a core | its loop thread | "
             "rank 0 (the one blocked) | rounds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for (tree, np, mode), rows in got.items():
        med = [statistics.median(col) for col in zip(*rows)]
        lines.append(f"| {tree.name} | {np} | {mode} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} "
                     f"| {', '.join(f'{r[0]:.1f}' for r in rows)} |")
    table = "\n".join(lines)
    print(table)
    print(f"load average {load:.2f} before, {load_after:.2f} after")
    if args.output:
        command = "python scripts/cpu_idle.py " + " ".join(sys.argv[1:])
        args.output.write_text(
            "# CPU of a waiting runtime\n\n"
            f"Command: `{command}`\n\n"
            f"{os.cpu_count()} cores; load average {load:.2f} before, {load_after:.2f} after.\n\n"
            f"{table}\n")


if __name__ == "__main__":
    main()
