"""The parameter server's sync modes against allreduce training, with and without a straggler.

Six ways to train the same MLP on scikit-learn's digits with 4 workers, each run under
``mpiexec``: the parameter server (1 server rank + 4 workers, ``examples/train_ps.py``) in
``bsp``, ``asp``, ``ssp`` (staleness 3) and ``adaptive`` mode, fusionring's allreduce
``DistributedOptimizer`` (synchronous, 4 ranks) and torch DDP over gloo (4 ranks). Every
contender uses the same model, data split, batch size, learning rate and epochs, and worker
0 logs the test accuracy and the seconds since the start after each of its epochs.

With ``--straggler`` the last worker sleeps before each step so that its steps take about
3x the others' (the delay is 2x the median step time of an equal-speed ``asp`` run, measured
first). Seeds are the outer loop and contenders the inner one, so runs of one seed share
the machine's load; the contenders' order turns with each seed. With ``--rate`` every run
goes through ``fusionrun --cluster`` instead: one emulated host per rank, joined by links
of that rate (root). The report gives accuracy against wall time (mean over seeds), the time
each contender needs to reach bsp's final accuracy, samples per second, and the targets.

    python scripts/bench_ps.py --seeds 0,1,2 --epochs 20 --output docs/benchmarks/ps.md
    python scripts/bench_ps.py --rate 1gbit --seeds 0,1,2 --epochs 20 --output docs/benchmarks/ps-1gbit.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_ps.py"
PS_MODES = {"ps-bsp": ["--sync", "bsp"], "ps-asp": ["--sync", "asp"],
            "ps-ssp3": ["--sync", "ssp", "--staleness", "3"], "ps-adaptive": ["--sync", "adaptive"]}
CONTENDERS = list(PS_MODES) + ["fusionring-allreduce", "ddp-gloo"]
WORKERS = 4
RELAUNCHED: Dict[tuple, str] = {}  # (contender, seed, straggler delay) -> why its first launch failed


# ---------------------------------------------------------------------- the allreduce peers
def _example_module():
    spec = importlib.util.spec_from_file_location("train_ps_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def allreduce_worker(args: argparse.Namespace) -> None:
    """One rank of the synchronous peers: the example's model, data shard and logging."""
    import torch
    import torch.nn.functional as F
    from fusionring.datasets import load_digits_split

    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if args.worker == "ddp-gloo":
        from mpi4py import MPI
        from fusionring.bench import init_gloo
        # rank 0's address on the emulated cluster's interface (set in each of its hosts), else loopback
        init_gloo(MPI.COMM_WORLD, os.environ.get("FI_TCP_IFACE") or "lo")
    else:
        import fusionring.torch as hvd
        hvd.init()
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    x_shard, y_shard = x_train[rank::size], y_train[rank::size]
    model = _example_module().build_model(args.hidden)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.worker == "ddp-gloo":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = sgd
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    slow = args.slow_delay_ms / 1000.0 if rank == size - 1 else 0.0
    generator = torch.Generator().manual_seed(args.seed + rank)
    log = open(args.log, "w") if rank == 0 else None
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            if slow:
                time.sleep(slow)
            opt.zero_grad()
            F.cross_entropy(model(x_shard[idx]), y_shard[idx]).backward()
            opt.step()
        if log:
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            log.write(json.dumps({"epoch": epoch + 1, "seconds": time.perf_counter() - start,
                                  "accuracy": accuracy}) + "\n")
            log.flush()
    if args.worker == "ddp-gloo":
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    else:
        hvd.shutdown()


# ---------------------------------------------------------------------- driving the runs
def run_one(contender: str, seed: int, args: argparse.Namespace, delay_ms: float) -> List[dict]:
    """Run one contender once; worker 0's per-epoch log (seconds, accuracy)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        common = ["--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
                  "--hidden", str(args.hidden), "--seed", str(seed), "--slow-delay-ms", str(delay_ms),
                  "--log", str(log)]
        ranks = WORKERS + 1 if contender in PS_MODES else WORKERS
        if args.rate:  # one emulated host per rank, links of args.rate each way
            cmd = [sys.executable, "-m", "fusionring.launcher", "-np", str(ranks), "--cluster", str(ranks),
                   "--rate", args.rate]
        else:
            cmd = ["mpiexec", "-n", str(ranks)]
        if contender in PS_MODES:
            cmd += [sys.executable, str(EXAMPLE)] + PS_MODES[contender] + common
        else:
            cmd += [sys.executable, __file__, "--worker", contender] + common
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no hostnames
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 and not RELAUNCHED.get((contender, seed, delay_ms)):
            # One relaunch, named in the report: a peer that fails at exit (DDP over gloo sometimes
            # aborts after its last epoch) should not cost the whole benchmark.
            said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("fusionring lab")]
            RELAUNCHED[(contender, seed, delay_ms)] = (f"exit {done.returncode}, its last words: "
                                                       f"`{' / '.join(said[-2:])[-200:]}`")
            print(f"{contender} seed {seed} failed ({done.returncode}); launching it again", flush=True)
            return run_one(contender, seed, args, delay_ms)
        if done.returncode != 0:
            raise RuntimeError(f"{contender} seed {seed} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-2000:]}")
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def time_to(curve: List[dict], accuracy: float) -> Optional[float]:
    """The first logged time at which ``curve`` reaches ``accuracy`` (None if it never does)."""
    for point in curve:
        if point["accuracy"] >= accuracy - 1e-9:
            return point["seconds"]
    return None


def summarize(runs: Dict[str, Dict[int, List[dict]]], samples: int) -> Dict[str, dict]:
    """Per contender: final accuracy, training time, samples/s and time to bsp's final accuracy
    (each per seed, against the same seed's bsp run), as medians and per-seed lists."""
    out: Dict[str, dict] = {}
    for contender, by_seed in runs.items():
        finals, times, reach = [], [], []
        for seed, curve in by_seed.items():
            finals.append(curve[-1]["accuracy"])
            times.append(curve[-1]["seconds"])
            bsp = runs.get("ps-bsp", {}).get(seed)
            if bsp:
                t = time_to(curve, bsp[-1]["accuracy"])
                reach.append(None if t is None else t / bsp[-1]["seconds"])
        out[contender] = {"final": finals, "seconds": times, "reach_ratio": reach,
                          "samples_per_s": [samples / t for t in times]}
    return out


def _fmt(values: List[Optional[float]], spec: str) -> str:
    return ", ".join("never" if v is None else format(v, spec) for v in values)


def _median(values: List[Optional[float]]) -> Optional[float]:
    """Median with "never" (None) counted as slower than any time; None when the median is never."""
    m = statistics.median([float("inf") if v is None else v for v in values])
    return None if m == float("inf") else m


def plot(runs: Dict[str, Dict[int, List[dict]]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for contender, by_seed in runs.items():
        curves = list(by_seed.values())
        epochs = min(len(c) for c in curves)
        xs = [statistics.mean(c[e]["seconds"] for c in curves) for e in range(epochs)]
        ys = [statistics.mean(c[e]["accuracy"] for c in curves) for e in range(epochs)]
        ax.plot(xs, ys, marker="o", markersize=3, label=contender)
    ax.set_xlabel("wall time of worker 0 (s), mean over seeds")
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(name: str, runs, summary, delay_ms: float, load: str, png: str) -> List[str]:
    lines = [f"## {name}", "", f"Straggler delay: {delay_ms:.1f} ms per step on the last worker. {load}", "",
             f"![{name}]({png})", "",
             "| contender | final accuracy, median | per seed | training s, median | samples/s, median "
             "| time to bsp's final accuracy / bsp's time, per seed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for contender, s in summary.items():
        lines.append(f"| {contender} | {statistics.median(s['final']):.4f} | {_fmt(s['final'], '.4f')} | "
                     f"{statistics.median(s['seconds']):.2f} | {statistics.median(s['samples_per_s']):.0f} | "
                     f"{_fmt(s['reach_ratio'], '.2f')} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--cases", default="equal,straggler",
                        help="comma-separated: equal, straggler (both by default)")
    parser.add_argument("--rate", help="run every contender on the emulated cluster (fusionrun --cluster, "
                        "root), one host per rank, with links of this rate each way (e.g. 1gbit)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--slow-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        allreduce_worker(args)
        return

    from fusionring.datasets import load_digits_split
    seeds = [int(s) for s in args.seeds.split(",")]
    contenders = args.contenders.split(",")
    for name in contenders:
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")
    if len(set(contenders)) != len(contenders):
        parser.error(f"--contenders names one twice: {args.contenders}")
    cases = args.cases.split(",")
    for case in cases:
        if case not in ("equal", "straggler"):
            parser.error(f"unknown case {case!r}; known: equal, straggler")
    train_size = len(load_digits_split(seeds[0])[0][0])
    samples = train_size * args.epochs
    steps_per_worker = args.epochs * -(-(train_size // WORKERS) // args.batch_size)
    report: List[str] = []
    results = {}
    delay_ms = 0.0
    for case in ("equal", "straggler"):
        if case not in cases:
            continue
        if case == "straggler":
            # 3x slower: sleep twice the step time of an equal-speed asynchronous worker
            probe = run_one("ps-asp", seeds[0], args, 0.0)
            delay_ms = 2000.0 * probe[-1]["seconds"] / steps_per_worker
        load_before = os.getloadavg()[0]
        runs: Dict[str, Dict[int, List[dict]]] = {c: {} for c in contenders}
        for n, seed in enumerate(seeds):
            # The order turns with each seed, so no contender always runs first in a round
            # (the machine's load drifts within a round).
            for contender in contenders[n % len(contenders):] + contenders[:n % len(contenders)]:
                runs[contender][seed] = run_one(contender, seed, args, delay_ms if case == "straggler" else 0.0)
                print(f"{case} seed {seed} {contender}: {runs[contender][seed][-1]}", flush=True)
        load = f"Load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} cores)."
        summary = summarize(runs, samples)
        results[case] = {"runs": runs, "summary": summary, "delay_ms": delay_ms, "load": load}
        if args.output:
            png = args.output.with_name(f"{args.output.stem}-{case}.png")
            plot(runs, png, f"{WORKERS} workers, {'one 3x slower' if case == 'straggler' else 'equal speed'}")
            title = "Equal-speed workers" if case == "equal" else "One worker 3x slower"
            report += section(title, runs, summary, delay_ms if case == "straggler" else 0.0, load, png.name)
    targets = ["## Targets", ""]
    if "straggler" in results:
        s = results["straggler"]["summary"]
        if "ps-adaptive" in s and "ps-bsp" in s:
            ratios = s["ps-adaptive"]["reach_ratio"]
            med = _median(ratios)
            met = med is not None and med <= 0.6
            targets.append(f"- Straggler: adaptive reaches bsp's final accuracy in {_fmt(ratios, '.2f')} of bsp's "
                           f"time per seed (median {'never' if med is None else format(med, '.2f')}; target <= "
                           f"0.60): {'met' if met else 'not met'}.")
        if "ps-adaptive" in s and "ps-asp" in s:
            a, b = statistics.median(s["ps-adaptive"]["final"]), statistics.median(s["ps-asp"]["final"])
            targets.append(f"- Straggler: adaptive's final accuracy {a:.4f} against asp's {b:.4f} (median over "
                           f"seeds; target: at least asp's): {'met' if a >= b else 'not met'}.")
    if "equal" in results:
        s = results["equal"]["summary"]
        if "ps-bsp" in s:
            bsp = statistics.median(s["ps-bsp"]["samples_per_s"])
            for mode in ("ps-asp", "ps-adaptive"):
                if mode in s:
                    r = statistics.median(s[mode]["samples_per_s"]) / bsp
                    targets.append(f"- Equal speed: {mode} runs {r:.2f}x bsp's samples per second (target: not "
                                   f"below 1.00): {'met' if r >= 1.0 else 'not met'}.")
    if RELAUNCHED:
        targets += ["", "Launched twice (the first launch failed; the second one's figures are used):"]
        targets += [f"- {c}, seed {seed}, straggler delay {delay:.1f} ms: {why}"
                    for (c, seed, delay), why in RELAUNCHED.items()]
    for line in targets:
        print(line)
    if args.output:
        command = "python scripts/bench_ps.py " + " ".join(sys.argv[1:])
        where = f" on the emulated {args.rate} cluster" if args.rate else ""
        head = [f"# Parameter server: sync modes against allreduce training{where}", "",
                f"Command: `{command}`", "",
                f"The digits MLP of `examples/train_ps.py` (hidden {args.hidden}), {WORKERS} workers, batch "
                f"{args.batch_size} per worker, plain SGD with lr {args.lr}, {args.epochs} epochs, seeds {seeds}. "
                "The parameter server runs 1 server rank beside the workers (5 processes); "
                "fusionring's allreduce optimizer and DDP run 4. Times are worker 0's, from its first step; "
                "accuracy is worker 0's model on the test split after each of its epochs. All processes share "
                f"{os.cpu_count()} cores, so every figure is CPU-bound."
                + (f" Every run is on the emulated cluster (`fusionrun --cluster`): one network namespace "
                   f"per rank, links of {args.rate} each way through one bridge, MPI over TCP, no shared "
                   f"memory." if args.rate else ""), ""]
        args.output.write_text("\n".join(head + targets + [""] + report))
        (args.output.with_suffix(".json")).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
