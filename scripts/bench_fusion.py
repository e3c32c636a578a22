"""Tensor fusion in training: no fusion vs threshold fusion vs plan-based fusion vs torch DDP.

Two models, each trained with SGD on a fixed random batch per rank:

* ``small``: a deep residual MLP (pre-norm blocks: LayerNorm, Linear, GELU, Linear) with about
  150 parameter tensors of very different sizes (LayerNorm vectors, biases, weight matrices);
* ``large``: a plain MLP with a few large weight matrices.

Configurations (one ``mpiexec`` launch per model; inside it the configurations alternate round
by round, the order rotating, so slow drift of a shared machine hits all of them alike):

* ``none``: ``hvd.DistributedOptimizer``, FUSIONRING_FUSION_THRESHOLD=0 (one allreduce per tensor);
* ``threshold``: threshold fusion as fusionring does it by default: the default threshold, 1 ms
  cycle, gradients kept in one buffer in ready order after the first step (reduced where they
  lie);
* ``packed``: Horovod's threshold fusion: the same, with FUSIONRING_GRADIENT_BUFFER=0, so every
  fused batch is copied into the fusion buffer and back;
* ``plan``: ``DistributedOptimizer(grouping_plan=make_plan(model, batch, world_size=N))``, the
  plan's default buffer rule (a ring over 15 us / 1 GB/s links, plus 60 us per buffer);
  ``--plan-buffers auto,mpi,learned,8MiB`` adds a plan whose buffer comes from timing
  MPI_Allreduce on this machine (``make_plan(probe="mpi")``, configuration ``plan@mpi``), the
  groups the optimizer learns in the first step (``grouping_plan="auto"``, ``plan@learned``) and
  a plan with an explicit buffer (``plan@8388608``);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, bucket_cap_mb=25;
* ``compute``: the same steps without any communication (the floor).

The fusionring runtime runs only during its own configurations (re-initialised with that
configuration's settings), so its background loop does not take CPU from DDP's steps.
Reported per configuration: median step time (rank 0, steps after the warm-up of each round,
pooled over rounds), allreduce calls per step (fusionring: ``allreduce_batches`` delta; DDP: its
bucket count) and the coefficient of variation of the fused buffer sizes.

    python scripts/bench_fusion.py                      # 4 ranks, writes docs/benchmarks/fusion.md
    python scripts/bench_fusion.py --models small --rounds 3 --no-doc
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from fusionring.bench.util import (add_run_options, finish_run, start_run, DOCS_DIR, BenchDoc,
                                   bar_plot, coefficient_of_variation, format_bytes, format_ratio,
                                   free_port, launch_under_mpiexec, load_average, parse_sizes,
                                   print_table, ratio, Run, summarize, write_result)  # noqa: E402

CONFIGS = ("none", "packed", "threshold", "plan", "ddp", "compute")
LABELS = {"none": "no fusion", "threshold": "threshold fusion",
          "packed": "threshold fusion, packed (Horovod)", "plan": "plan-based fusion",
          "ddp": "torch DDP (gloo, 25 MB)", "compute": "compute only (no allreduce)"}
DDP_BUCKET_CAP_MB = 25
THRESHOLD_CYCLE_TIME_MS = 1.0



def label(name: str) -> str:
    """Readable name of a configuration ('plan@8388608' -> 'plan-based fusion, 8 MiB buffer')."""
    if name == "plan@mpi":
        return "plan-based fusion, measured cost model"
    if name == "plan@learned":
        return "plan-based fusion, learned in the first step"
    if name.startswith("plan@"):
        return f"plan-based fusion, {format_bytes(int(name[5:]))} buffer"
    return LABELS[name]


def short_label(name: str) -> str:
    """Axis label: 'none', 'threshold', 'plan', 'plan 8 MiB', 'DDP', 'compute'."""
    if name == "plan@mpi":
        return "plan\nmeasured"
    if name == "plan@learned":
        return "plan\nlearned"
    if name.startswith("plan@"):
        return f"plan\n{format_bytes(int(name[5:]))}"
    return {"ddp": "DDP", "compute": "compute\nonly"}.get(name, name)


def plan_configs(text: str) -> List[str]:
    """'auto,mpi,learned,8MiB' -> ['plan', 'plan@mpi', 'plan@learned', 'plan@8388608']."""
    out = []
    for token in text.split(","):
        token = token.strip()
        if token == "auto":
            out.append("plan")
        elif token in ("mpi", "learned"):
            out.append(f"plan@{token}")
        elif token:
            out.append(f"plan@{parse_sizes(token)[0]}")
    return out


# Targets on the many-small-tensor model.
TARGET_PLAN_VS_THRESHOLD = 0.85
TARGET_CV = 0.25


# --------------------------------------------------------------------------------------------
# Models


def build_model(kind: str, args: argparse.Namespace):
    """The benchmark model, identical on every rank (fixed seed)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "small":
        class Block(nn.Module):
            def __init__(self, width: int, hidden: int):
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.up = nn.Linear(width, hidden)
                self.down = nn.Linear(hidden, width)

            def forward(self, x):
                return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

        class ResidualMLP(nn.Module):
            def __init__(self, width: int, hidden: int, depth: int, classes: int = 10):
                super().__init__()
                self.stem = nn.Linear(width, width)
                self.blocks = nn.Sequential(*[Block(width, hidden) for _ in range(depth)])
                self.norm = nn.LayerNorm(width)
                self.head = nn.Linear(width, classes)

            def forward(self, x):
                return self.head(self.norm(self.blocks(self.stem(x))))

        return ResidualMLP(args.width, args.hidden, args.depth)
    if kind == "large":
        width = args.large_width
        layers = []
        for i in range(args.large_layers):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers += [nn.Linear(width, 10)]
        return nn.Sequential(*layers)
    raise ValueError(f"unknown model {kind!r}")


def input_width(kind: str, args: argparse.Namespace) -> int:
    return args.width if kind == "small" else args.large_width


# --------------------------------------------------------------------------------------------
# Worker (one process per rank, under mpiexec)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import fusionring.torch as hvd
    from fusionring import config as fr_config
    from fusionring.plan import make_plan

    torch.set_num_threads(args.threads)  # 1 by default: ranks share the cores
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)

    kind = args.model
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, input_width(kind, args), generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()

    probe_model = build_model(kind, args)
    tensors = [p for p in probe_model.parameters() if p.requires_grad]
    model_info = {"tensors": len(tensors),
                  "bytes": sum(p.numel() * p.element_size() for p in tensors)}
    configs = [c for c in args.configs.split(",") if c]
    plans, plan_info = {}, {}
    for name in configs:
        if name == "plan@learned":
            plans[name] = "auto"  # DistributedOptimizer groups from the first step's order
        elif name.startswith("plan"):
            suffix = name[5:]
            buffer_bytes = int(suffix) if suffix.isdigit() else None
            # "mpi" times MPI_Allreduce on every rank (collective; all ranks fit the same model).
            plans[name] = make_plan(probe_model, (x,), world_size=size, buffer_bytes=buffer_bytes,
                                    loss_fn=lambda out: loss_fn(out, y),
                                    probe="mpi" if suffix == "mpi" else None)
            plan_info[name] = {"groups": len(plans[name].groups),
                               "buffer_bytes": plans[name].buffer_bytes,
                               "group_bytes": plans[name].group_bytes,
                               "group_cv": coefficient_of_variation(plans[name].group_bytes)}

    base_env = {k: v for k, v in os.environ.items() if k.startswith("FUSIONRING_")}

    def configure(name: str) -> None:
        """Settings for one fusionring configuration, read afresh by the next hvd.init()."""
        for k in [k for k in os.environ if k.startswith("FUSIONRING_")]:
            del os.environ[k]
        os.environ.update(base_env)
        os.environ["FUSIONRING_CYCLE_TIME_MS"] = str(THRESHOLD_CYCLE_TIME_MS)
        if name == "none":
            os.environ["FUSIONRING_FUSION_THRESHOLD"] = "0"
        if name == "packed":
            os.environ["FUSIONRING_GRADIENT_BUFFER"] = "0"
        if args.trace_dir and rank == 0:
            os.environ["FUSIONRING_TIMELINE"] = os.path.join(args.trace_dir,
                                                             f"{kind}-{name}.json")
        fr_config.settings(reload=True)

    def run_round(name: str, steps: int) -> dict:
        model = build_model(kind, args)
        if name == "compute":
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        elif name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model,
                                                              bucket_cap_mb=DDP_BUCKET_CAP_MB)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        else:
            configure(name)
            hvd.init()
            optimizer = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=args.lr),
                named_parameters=model.named_parameters(),
                grouping_plan=plans.get(name))
        times: List[float] = []
        batches_before = bytes_before = 0
        for step in range(args.warmup + steps):
            if step == args.warmup and name not in ("ddp", "compute"):
                stats = hvd.communication_stats()
                batches_before = stats["allreduce_batches"]
                bytes_before = len(stats["batch_bytes"])
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        out = {"times": times}
        if name == "compute":
            out.update(calls_per_step=0, batch_bytes=[])
        elif name == "ddp":
            data = model._get_ddp_logging_data()
            sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
            out.update(calls_per_step=len(sizes), batch_bytes=sizes)
        else:
            stats = hvd.communication_stats()
            out.update(calls_per_step=(stats["allreduce_batches"] - batches_before) / steps,
                       batch_bytes=stats["batch_bytes"][bytes_before:])
            hvd.shutdown()
        return out

    results: Dict[str, List[dict]] = {c: [] for c in configs}
    started = time.perf_counter()
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name in order:
            comm.Barrier()
            results[name].append(run_round(name, args.steps))
            if args.trace_dir and rank == 0 and name not in ("ddp", "compute"):
                os.replace(os.path.join(args.trace_dir, f"{kind}-{name}.json"),
                           os.path.join(args.trace_dir, f"{kind}-{name}-round{r}.json"))
        if rank == 0:
            print(f"[{kind}] round {r + 1}/{args.rounds} done after "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        write_result({"model": kind, "ranks": size, "model_info": model_info, "plan": plan_info,
                      "rounds": results, "load": load_average(), "steps": args.steps,
                      "warmup": args.warmup})


# --------------------------------------------------------------------------------------------
# Launcher and report


def config_summary(result: dict) -> Dict[str, dict]:
    """Per configuration: median step time (pooled), per-round medians, calls, CV, sizes."""
    out = {}
    for name, rounds in result["rounds"].items():
        pooled = [t for r in rounds for t in r["times"]]
        per_round = [summarize(r["times"]).median for r in rounds]
        sizes = [b for r in rounds for b in r["batch_bytes"]]
        calls = summarize([r["calls_per_step"] for r in rounds]).median
        out[name] = {"step": summarize(pooled), "round_medians": per_round,
                     "calls": calls, "cv": coefficient_of_variation(sizes),
                     "mean_bytes": sum(sizes) / len(sizes) if sizes else 0,
                     "min_bytes": min(sizes) if sizes else 0,
                     "max_bytes": max(sizes) if sizes else 0}
    return out


def table(result: dict):
    summary = config_summary(result)
    ref = summary.get("threshold", {}).get("step")
    headers = ["configuration", "step time (median)", "IQR", "vs threshold", "allreduce calls/step",
               "fused buffer mean", "min..max", "CV of buffer sizes"]
    rows = []
    for name, s in summary.items():
        rows.append([label(name), f"{s['step'].median * 1e3:.1f} ms",
                     f"{s['step'].p25 * 1e3:.1f}-{s['step'].p75 * 1e3:.1f} ms",
                     format_ratio(ratio(s["step"].median, ref.median)) if ref else "n/a",
                     f"{s['calls']:.1f}", format_bytes(s["mean_bytes"]),
                     f"{format_bytes(s['min_bytes'])}..{format_bytes(s['max_bytes'])}",
                     f"{s['cv']:.2f}"])
    return headers, rows


def targets(results: List[dict]) -> List[str]:
    """Whether the targets hold on the many-small-tensor model, for every plan configuration."""
    result = next((r for r in results if r["model"] == "small"), None)
    if result is None:
        return []
    s = config_summary(result)

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    for name in [n for n in s if n.startswith("plan")]:
        step = s[name]["step"].median
        # The target is set against Horovod's threshold fusion (each fused batch packed);
        # fusionring's own default, which keeps gradients in one buffer, is reported beside it.
        if "packed" in s:
            rel = step / s["packed"]["step"].median
            lines.append(f"{label(name)}: step time {rel:.2f}x Horovod-style threshold fusion "
                         f"(target <= {TARGET_PLAN_VS_THRESHOLD}): "
                         f"{verdict(rel <= TARGET_PLAN_VS_THRESHOLD)}")
        if "threshold" in s:
            rel = step / s["threshold"]["step"].median
            lines.append(f"{label(name)}: step time {rel:.2f}x fusionring's default threshold "
                         f"fusion (no target)")
        if "ddp" in s:
            rel = step / s["ddp"]["step"].median
            lines.append(f"{label(name)}: step time {rel:.2f}x DDP (target <= 1.0): "
                         f"{verdict(rel <= 1.0)}")
        cv = s[name]["cv"]
        lines.append(f"{label(name)}: CV of fused buffer sizes {cv:.2f} (target <= {TARGET_CV}): "
                     f"{verdict(cv <= TARGET_CV)}")
    return lines


def plot(results: List[dict], path: str) -> None:
    panels = []
    for result in results:
        s = config_summary(result)
        names = list(s)
        panels.append({
            "title": f"{result['model']} model ({result['model_info']['tensors']} tensors, "
                     f"{format_bytes(result['model_info']['bytes'])}), {result['ranks']} ranks",
            "ylabel": "step time (ms)",
            "groups": [short_label(n) for n in names],
            "series": {"median step (whiskers: IQR)": [s[n]["step"].median * 1e3 for n in names]},
            "errors": {"median step (whiskers: IQR)": [(s[n]["step"].p25 * 1e3,
                                                        s[n]["step"].p75 * 1e3) for n in names]},
        })
    bar_plot(path, panels)


def write_doc(run: Run, args: argparse.Namespace, path: str, png: str) -> None:
    results, command = run.results, run.command
    doc = BenchDoc("Tensor fusion: none vs threshold vs plan-based vs torch DDP", command=command)
    doc.paragraph(
        "Data-parallel SGD steps (forward, backward, gradient allreduce, update) on a fixed "
        "random batch per rank. fusionring configurations use `hvd.DistributedOptimizer`: "
        "**no fusion** (FUSIONRING_FUSION_THRESHOLD=0: one allreduce per gradient), **threshold "
        f"fusion** (the default: default threshold, {THRESHOLD_CYCLE_TIME_MS:g} ms cycle, whatever "
        "is ready in a cycle is fused; after the first step the gradients lie in one buffer in "
        "ready order, so a fused batch is reduced where it lies), **threshold fusion, packed** "
        "(as Horovod does it: FUSIONRING_GRADIENT_BUFFER=0, each fused batch copied into the "
        "fusion buffer and back), **plan-based fusion** (`grouping_plan=make_plan(model, "
        "batch, world_size=N)`: balanced groups contiguous in backward order; buffer size from "
        "the plan's default rule, from `probe=\"mpi\"` (measured cost model) or explicit). "
        "**compute only**: the same steps with no communication. **torch DDP**: `DistributedDataParallel` over gloo "
        f"with bucket_cap_mb={DDP_BUCKET_CAP_MB}. One `mpiexec` launch per model; inside it the "
        "configurations alternate round by round with the order rotated; the fusionring runtime "
        "is started for its own rounds only. Step time: rank 0, median over "
        f"{args.steps} steps x {args.rounds} rounds (after {args.warmup} warm-up steps per round). "
        "Calls/step: fusionring's `allreduce_batches` per step, DDP's bucket count. CV: standard "
        "deviation / mean of the fused buffer sizes (`communication_stats()['batch_bytes']`, "
        "DDP's bucket sizes).")
    lines = targets(results)
    if lines:
        doc.heading("Targets (many-small-tensor model)")
        doc.bullets(lines)
    for result in results:
        info = result["model_info"]
        doc.heading(f"{result['model']} model: {info['tensors']} tensors, "
                    f"{format_bytes(info['bytes'])}, {result['ranks']} ranks")
        headers, rows = table(result)
        doc.table(headers, rows, "lrrrrrrr")
        plans = "; ".join(
            f"{label(n)}: {p['groups']} groups of {format_bytes(min(p['group_bytes']))}.."
            f"{format_bytes(max(p['group_bytes']))} (buffer {format_bytes(p['buffer_bytes'])}, "
            f"CV {p['group_cv']:.2f})" for n, p in result["plan"].items())
        doc.paragraph(
            f"Plans: {plans}. Per-round medians (ms): " + "; ".join(
                f"{label(n)} " + ", ".join(f"{t * 1e3:.0f}" for t in s["round_medians"])
                for n, s in config_summary(result).items()) + ".")
    doc.image(png, "median step time per configuration")
    doc.keep_section(path, "Findings")
    doc.heading("Conditions")
    doc.conditions(run.machine, run.loads)
    doc.paragraph(
        "2 cores shared by all ranks (4 ranks oversubscribe them) while other jobs ran on the "
        "machine, so absolute times are noisy; the interleaving makes the ratios the robust "
        "part. Model sizes: small = residual MLP width "
        f"{args.width}, hidden {args.hidden}, depth {args.depth}, batch {args.batch}; large = "
        f"{args.large_layers} x Linear({args.large_width}, {args.large_width}) + head, "
        f"batch {args.batch}.")
    doc.write(path)


def expand_configs(configs: str, plan_buffers: str) -> str:
    """The worker's configuration list: 'plan' expands to one entry per plan buffer."""
    out = []
    for name in configs.split(","):
        name = name.strip()
        if name == "plan":
            out += plan_configs(plan_buffers)
        elif name in CONFIGS:
            out.append(name)
        elif name:
            raise SystemExit(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    return ",".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"from {', '.join(CONFIGS)}")
    parser.add_argument("--plan-buffers", default="auto",
                        help="one plan configuration each: auto (the plan's default rule), mpi "
                             "(probed cost model), learned (grouping_plan='auto') or a buffer "
                             "size such as 8MiB")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per configuration")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--large-width", type=int, default=2048)
    parser.add_argument("--large-layers", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per rank, set before hvd.init() (whose "
                             "FUSIONRING_TORCH_THREADS=auto lowers a count that oversubscribes "
                             "the cores)")
    parser.add_argument("--trace-dir", default="",
                        help="write rank 0's timeline of the threshold and plan rounds here")
    add_run_options(parser, os.path.join(DOCS_DIR, "fusion.md"))
    parser.add_argument("--model", default="small", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    run = start_run(args)
    if not args.from_results:
        loads = run.loads
        passthrough = ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup",
                       str(args.warmup), "--batch", str(args.batch), "--width", str(args.width),
                       "--hidden", str(args.hidden), "--depth", str(args.depth), "--large-width",
                       str(args.large_width), "--large-layers", str(args.large_layers), "--lr",
                       str(args.lr), "--threads", str(args.threads),
                       "--configs", expand_configs(args.configs, args.plan_buffers)]
        if args.trace_dir:
            passthrough += ["--trace-dir", os.path.abspath(args.trace_dir)]
        results = run.results
        for kind in args.models.split(","):
            result = launch_under_mpiexec(os.path.abspath(__file__), args.ranks,
                                          ["--worker", "--model", kind, *passthrough],
                                          env={"MASTER_ADDR": "127.0.0.1",
                                               "MASTER_PORT": str(free_port())},
                                          timeout_s=args.timeout_s)
            loads.append((f"after the {kind} model", result["load"]))
            results.append(result)
            info = result["model_info"]
            print(f"\n== {kind} model: {info['tensors']} tensors, {format_bytes(info['bytes'])}, "
                  f"{result['ranks']} ranks; plans: " + ", ".join(
                      f"{p['groups']} groups of {format_bytes(p['buffer_bytes'])}"
                      for p in result["plan"].values()))
            headers, rows = table(result)
            print_table(headers, rows)
    finish_run(run, args, targets, plot, lambda png: write_doc(run, args, args.doc, png))


if __name__ == "__main__":
    main()
