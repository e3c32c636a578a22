"""A model of many small gradients, timed: the cost of reducing each gradient on its own.

The model is ``--tensors`` parameters of ``--numel`` floats each and a loss that costs almost
nothing to differentiate, so a step's time is the libraries' per-gradient work: hooks,
submission, negotiation, fusion. Contenders, each launched with ``mpiexec -n NP`` and run
interleaved ``--rounds`` times:

- ``fusionring``: ``hvd.DistributedOptimizer`` (defaults), from each ``--tree`` given;
- ``ddp``: ``DistributedDataParallel`` over gloo (its buckets are filled in C++);
- ``horovod``: ``horovod.torch``'s ``DistributedOptimizer``, when it is importable;
- ``none``: the same loop without any communication (the floor).

The table gives each contender's median step (zero_grad, forward, backward, step), its ratio
to DDP's, and the training thread's CPU time in the backward pass (where gradient hooks run).

    python scripts/bench_many_tensors.py -np 2 --rounds 5 --tree new=. --tree old=../before \
        --output docs/benchmarks/many-tensors.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(library: str, tensors: int, numel: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    torch.manual_seed(0)

    class Many(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors))

        def forward(self, x):
            return sum((p * x).sum() for p in self.ps)

    model = Many()
    x = torch.randn(numel) + rank
    if library == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=size,
                                init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}")
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        barrier = dist.barrier
    elif library in ("fusionring", "horovod"):
        if library == "horovod":
            import horovod.torch as hvd
        else:
            import fusionring.torch as hvd
        hvd.init()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        barrier = hvd.barrier
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        barrier = lambda: None  # noqa: E731

    times, cpu = [], []
    for step in range(steps):
        if step == 3:
            barrier()
        started = time.perf_counter()
        opt.zero_grad()
        loss = model(x)
        cpu_before = time.thread_time()
        loss.backward()
        cpu_after = time.thread_time()
        opt.step()
        times.append(time.perf_counter() - started)
        cpu.append(cpu_after - cpu_before)
    if rank == 0:
        kept = slice(3, None)  # the first steps lay out buffers and learn the order
        print("RESULT " + json.dumps({"step_ms": 1e3 * statistics.median(times[kept]),
                                      "backward_cpu_ms": 1e3 * statistics.median(cpu[kept])}),
              flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(label: str, library: str, tree: Path, np_: int, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), BENCH_PORT=str(_free_port()))
    ranks = 1 if library == "none" else np_
    command = ["mpiexec", "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
               "--worker", library, "--tensors", str(args.tensors), "--numel",
               str(args.numel), "--steps", str(args.steps)]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True,
                          timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{label} failed (rc {done.returncode}):\n{done.stdout}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--tensors", type=int, default=1000, help="parameters (default 1000)")
    parser.add_argument("--numel", type=int, default=256, help="floats each (default 256)")
    parser.add_argument("--steps", type=int, default=40, help="steps per launch (default 40)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--tree", action="append",
                        help="a fusionring checkout to time, as PATH or LABEL=PATH (repeatable; "
                             "default this one)")
    parser.add_argument("--output", type=Path, help="write a Markdown report and a plot here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.tensors, args.numel, args.steps)
        return

    contenders = []
    for given in args.tree or [str(ROOT)]:
        label, _, path = given.rpartition("=") if "=" in given else (None, "", given)
        tree = Path(path).resolve()
        name = label or (tree.name if args.tree and len(args.tree) > 1 else "")
        contenders.append((f"fusionring ({name})" if name else "fusionring", "fusionring", tree))
    contenders.append(("ddp", "ddp", ROOT))
    if importlib.util.find_spec("horovod") is not None:
        contenders.append(("horovod", "horovod", ROOT))
    contenders.append(("none (1 rank, no communication)", "none", ROOT))
    results = {label: [] for label, _, _ in contenders}
    for round_ in range(args.rounds):
        for label, library, tree in contenders:
            result = launch(label, library, tree, args.np, args)
            results[label].append(result)
            print(f"round {round_ + 1}: {label:34s} step {result['step_ms']:7.1f} ms  "
                  f"backward cpu {result['backward_cpu_ms']:7.1f} ms", flush=True)

    step = {k: statistics.median(r["step_ms"] for r in v) for k, v in results.items()}
    back = {k: statistics.median(r["backward_cpu_ms"] for r in v) for k, v in results.items()}
    rows = ["| contender | step (ms) | / ddp | backward CPU, training thread (ms) | steps per round (ms) |",
            "| --- | --- | --- | --- | --- |"]
    for label in results:
        per_round = ", ".join(f"{r['step_ms']:.1f}" for r in results[label])
        rows.append(f"| {label} | {step[label]:.1f} | {step[label] / step['ddp']:.2f} | "
                    f"{back[label]:.1f} | {per_round} |")
    table = "\n".join(rows)
    print(table)
    if args.output is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot = args.output.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = list(results)
    ax.barh(labels, [step[k] for k in labels], color="#4c72b0", label="step")
    ax.barh(labels, [back[k] for k in labels], color="#dd8452", height=0.4,
            label="backward CPU (training thread)")
    ax.set_xlabel("ms (median)")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{args.tensors} gradients of {args.numel} floats, {args.np} ranks")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    command = "python scripts/bench_many_tensors.py " + " ".join(sys.argv[1:])
    args.output.write_text(
        f"# Many small gradients: {args.tensors} of {args.numel} floats, {args.np} ranks\n\n"
        f"Made with:\n\n```\n{command}\n```\n\n"
        f"Each launch runs {args.steps} steps (the first 3 left out); {args.rounds} rounds, "
        f"contenders interleaved. The loss costs almost nothing to differentiate, so the step "
        f"is the libraries' per-gradient work. See the script's docstring for the contenders."
        f"\n\n{table}\n\n![steps]({plot.name})\n")
    print(f"wrote {args.output} and {plot}")


if __name__ == "__main__":
    main()
