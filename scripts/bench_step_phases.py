"""Where a training step's time goes on the emulated cluster, across ranks: fusionring's
``DistributedOptimizer``, DDP over gloo, and the same training with no communication at all.

The model, data and recipe are ``scripts/bench.py``'s (``--mode train``): the MLP on digits,
64 -> hidden x depth -> 10, batch 32 per rank, SGD with momentum. Every rank stamps each step
with ``time.perf_counter()``; the lab's ranks share one machine and so one monotonic clock,
which lets rank 0 put the ranks' stamps on one time line. Per step (medians over steps):

- ``step``: from the first rank's start to the last rank's end;
- ``first_big_ready``: when the last rank had the gradient of the first large layer ready
  (the earliest moment a collective carrying most of the bytes can start);
- ``comm_after``: from then until the last rank's gradients were all reduced;
- ``opt``: the optimizer step after that, on the last rank;
- ``link``: what the link needs for the ring's bytes after ``first_big_ready`` at the most TCP
  payload a shaped link carries (95.6 % of its rate).

The report's floor, for any data-parallel step that reduces every gradient before the
optimizer step: ``first_big_ready`` with no communication (``none``: the compute with nothing
else on the cores; each step starts at the same instant on every rank, through a timed sleep,
not a collective) + ``link`` + the fastest communicating contender's ``opt`` (its ranks all
step at once after the reduction, sharing the cores).

    python scripts/bench_step_phases.py -np 4 --rate 1gbit --rounds 3 \
        --output docs/benchmarks/step-phases-1gbit.md

``--no-bias`` drops the layers' biases; ``--fp16`` sends float16 gradients
(``Compression.fp16`` against DDP's ``fp16_compress_hook``).

Needs root (the lab) and MPICH's mpiexec; contenders run interleaved, one launch each per
round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("fusionring", "ddp", "none")
PAYLOAD_SHARE = 0.956  # TCP payload per Ethernet frame (1448 of 1514 bytes), see docs/cluster.md


def worker(library: str, steps: int, hidden: int, depth: int, bias: bool, out: str,
           fp16: bool = False) -> None:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI
    from sklearn.datasets import load_digits

    sys.path.insert(0, str(ROOT))
    from fusionring.bench.contenders import build_model

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    net = build_model(hidden, depth, bias=bias)
    hvd = None
    if library == "fusionring":
        import fusionring.torch as hvd
        hvd.init()
        model = net
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=net.named_parameters(),
                                       compression=hvd.Compression.fp16 if fp16
                                       else hvd.Compression.none)
    elif library == "ddp":
        from fusionring.bench.probes import init_gloo
        init_gloo(comm, "eth0")
        model = torch.nn.parallel.DistributedDataParallel(net)
        if fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        model = net
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # The first large layer in backward order: the second Linear from the output.
    linears = [m for m in net if isinstance(m, torch.nn.Linear)]
    big = linears[-2].weight
    stamps: dict = {}
    big.register_post_accumulate_grad_hook(lambda p: stamps.__setitem__("big", time.perf_counter()))
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    rows = []
    base = None
    for i in range(steps):
        if library == "none":
            # Start together without a collective, whose waiting would take CPU.
            base = comm.bcast(time.time() + 0.2 if rank == 0 else None, root=0) if base is None \
                else base + 0.6
            time.sleep(max(0.0, base - time.time()))
        at = (i * size + rank) * 32 % (len(x) - 32)
        stamps.clear()
        stamps["start"] = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[at:at + 32]), y[at:at + 32])
        loss.backward()
        if library == "fusionring":
            opt.synchronize()
            stamps["reduced"] = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            stamps["reduced"] = time.perf_counter()  # DDP's backward returns reduced gradients
            opt.step()
        loss.item()
        stamps["end"] = time.perf_counter()
        rows.append(dict(stamps))
    everyone = comm.gather(rows, root=0)
    if rank == 0:
        ring_bytes = sum(p.numel() * p.element_size() for p in net.parameters()
                         if p is not linears[-1].weight and p is not linears[-1].bias)
        ring_bytes //= 2 if fp16 else 1  # float16 on the wire
        json.dump({"rows": everyone, "ring_bytes": ring_bytes * 2 * (size - 1) / size},
                  open(out, "w"))
    if hvd is not None:
        hvd.shutdown()
    elif library == "ddp":
        import torch.distributed as dist
        comm.Barrier()
        dist.destroy_process_group()
        comm.Barrier()


def summarize(result: dict, rate_bits: float, warmup: int) -> dict:
    """Medians over the steps after `warmup` of the cross-rank phases (milliseconds)."""
    rows = result["rows"]
    link = result["ring_bytes"] * 8 / (rate_bits * PAYLOAD_SHARE) * 1e3
    phases: dict = {}
    for i in range(warmup, len(rows[0])):
        step = [rows[r][i] for r in range(len(rows))]
        start = min(s["start"] for s in step)
        ready = max(s["big"] for s in step)
        reduced = max(s["reduced"] for s in step)
        values = {"step": max(s["end"] for s in step) - start,
                  "first_big_ready": ready - start,
                  "comm_after": reduced - ready,
                  "opt": max(s["end"] for s in step) - reduced}
        for key, value in values.items():
            phases.setdefault(key, []).append(value * 1e3)
    out = {key: statistics.median(v) for key, v in phases.items()}
    out["link"] = link
    return out


def launch(library: str, args: argparse.Namespace, out: Path) -> None:
    """One run of `library` in the lab; rank 0 writes its stamps to `out`."""
    command = [sys.executable, "-m", "fusionring.launcher", "-np", str(args.np),
               "--cluster", str(args.np), "--rate", args.rate,
               sys.executable, str(Path(__file__).resolve()), "--worker", library,
               "--steps", str(args.steps), "--hidden", str(args.hidden),
               "--depth", str(args.depth), "--out", str(out)]
    command += (["--no-bias"] if args.no_bias else []) + (["--fp16"] if args.fp16 else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no hostnames
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{library} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def rate_bits_per_s(rate: str) -> float:
    sys.path.insert(0, str(ROOT))
    from fusionring.cluster import parse_rate
    return float(parse_rate(rate))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-np", "--np", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--no-bias", action="store_true",
                        help="Linear layers without biases (no small gradients beside the large ones)")
    parser.add_argument("--fp16", action="store_true",
                        help="gradients travel as float16 (Compression.fp16; DDP's fp16_compress_hook)")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--output", default=None, help="write a markdown report here")
    parser.add_argument("--rerender", action="store_true",
                        help="render the report again from the last run's files in build/step-phases*")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.hidden, args.depth, not args.no_bias, args.out,
               args.fp16)
        return
    libraries = [name for name in args.libraries.split(",") if name]
    unknown = [name for name in libraries if name not in LIBRARIES]
    if unknown:
        parser.error(f"--libraries: unknown {', '.join(unknown)} (choose from {', '.join(LIBRARIES)})")
    rate = rate_bits_per_s(args.rate)
    results: dict = {name: [] for name in libraries}
    scratch = ROOT / "build" / ("step-phases" + ("-no-bias" if args.no_bias else "")
                                + ("-fp16" if args.fp16 else ""))
    scratch.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.rounds):
        for name in libraries:
            out = scratch / f"{name}-{round_}.json"
            if not args.rerender:
                out.unlink(missing_ok=True)
                launch(name, args, out)
            summary = summarize(json.loads(out.read_text()), rate, args.warmup)
            results[name].append(summary)
            print(f"round {round_ + 1} {name}: " +
                  " ".join(f"{k} {v:.1f}" for k, v in summary.items()), flush=True)
    plot = None
    if args.output:
        plot = Path(args.output).with_suffix(".png")
        draw(results, plot)
    report = render(results, args, plot)
    print(report)
    if args.output:
        Path(args.output).write_text(report)


def _medians(results: dict) -> dict:
    keys = ["step", "first_big_ready", "comm_after", "opt", "link"]
    return {name: {k: statistics.median(r[k] for r in runs) for k in keys}
            for name, runs in results.items()}


def _floor(med: dict):
    """The floor of a step that reduces everything before the optimizer step, or None."""
    communicating = [name for name in med if name != "none"]
    if "none" not in med or not communicating:
        return None
    # The optimizer step as the ranks run it after a reduction: all at once, cores shared.
    opt = min(med[name]["opt"] for name in communicating)
    return med["none"]["first_big_ready"] + med["none"]["link"] + opt, opt


def draw(results: dict, path: Path) -> None:
    """Stacked bars of the phases per library, with the floor as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = _medians(results)
    names = [n for n in med if n != "none"]
    fig, ax = plt.subplots(figsize=(7, 2.2 + 0.4 * len(names)))
    left = [0.0] * len(names)
    for key, colour in (("first_big_ready", "#8da0cb"), ("comm_after", "#fc8d62"),
                        ("opt", "#66c2a5")):
        widths = [med[n][key] for n in names]
        ax.barh(names, widths, left=left, color=colour, label=key)
        left = [a + b for a, b in zip(left, widths)]
    floor = _floor(med)
    if floor is not None:
        ax.axvline(floor[0], color="black", linestyle="--", label=f"floor {floor[0]:.0f} ms")
    ax.set_xlabel("ms per step (medians; the ranks on one time line)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(results: dict, args: argparse.Namespace, plot: Optional[Path]) -> str:
    keys = ["step", "first_big_ready", "comm_after", "opt", "link"]
    med = _medians(results)
    lines = [f"| library | {' | '.join(k + ' (ms)' for k in keys)} |",
             "| --- |" + " --- |" * len(keys)]
    for name, m in med.items():
        lines.append(f"| {name} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
    text = "\n".join(lines)
    floor = _floor(med)
    if floor is not None:
        floor, opt = floor
        text += (f"\n\nFloor of a step that reduces every gradient before the optimizer step: "
                 f"first_big_ready with no communication ({med['none']['first_big_ready']:.1f}) "
                 f"+ link ({med['none']['link']:.1f}) + the fastest contender's optimizer step "
                 f"({opt:.1f}) = **{floor:.1f} ms**.")
    command = " ".join(["python scripts/bench_step_phases.py"]
                       + [a for a in sys.argv[1:] if a != "--rerender"])
    runs = "\n".join(f"- {name}, step per round: " +
                     ", ".join(f"{r['step']:.1f}" for r in rs) + " ms"
                     for name, rs in results.items())
    return (f"# Where a step's time goes: {args.np} ranks, {args.rate} lab\n\n"
            f"Made with (as root, from the repository root):\n\n```\n{command}\n```\n\n"
            f"Medians over rounds of each launch's median step ({args.steps} steps, the first "
            f"{args.warmup} left out); {args.rounds} rounds, contenders alternated. Model: MLP "
            f"64 -> {args.hidden} x {args.depth} -> 10{' without biases' if args.no_bias else ''}, "
            f"batch 32 per rank{'; gradients travel as float16' if args.fp16 else ''}. The columns are "
            f"explained in the script's docstring.\n\n{text}\n\n{runs}\n"
            + (f"\n![phases]({plot.name})\n" if plot is not None else ""))


if __name__ == "__main__":
    main()
