"""Layer selection against dense training: accuracy, bytes per step, selection overhead.

    mpiexec -n 4 python scripts/bench_layers.py      # writes docs/benchmarks/layer-selection.md
                                                     # and its plots

Two models with at least eight parameter-owning layers, both on scikit-learn's bundled digits
(fusionring.datasets): an MLP of eight Linear layers (64-128x7-10), and a small ResNet-style
conv net on the 8x8 images (a stem, three residual blocks with a strided 1x1 shortcut, a
classifier: nine layers). Every configuration trains with hvd.DistributedOptimizer (SGD,
momentum 0.9) from the same initialisation and data order per seed; each rank takes its share
of every global batch. Contenders: dense, and hyper / norm / round_robin / random at fraction
0.25 and 0.5. Within one seed the contenders run back to back in an order rotated per seed,
so a burst of load from other work falls on several of them; step times are compared as
ratios to dense within the same seed.

Bytes per step: the growth of hvd.communication_stats()["bytes_sent"] over the run, divided
by the steps (the agreement's scores and the chosen layers; what rank 0 sends). Selection
overhead: the selector's own scoring per step (for hyper: the hypernetwork's forward,
backward and Adam step), timed around the selector's scores(), and the agreement alone (an
allreduce of one float64 per layer, timed 200 times after the run), beside the step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))  # this checkout's fusionring, not an installed one

import fusionring.torch as hvd  # noqa: E402
from fusionring.datasets import load_digits_split  # noqa: E402
from bench_nm import write_section  # noqa: E402

KINDS = ["hyper", "norm", "round_robin", "random"]
FRACTIONS = [0.25, 0.5]
# hyper's default lets a waiting layer's probability accumulate until it is sent; the
# "hyper-topk" rows take each step's k most probable alone (accumulate=False), the seed's
# literal rule, with which a layer whose alpha stays still waits as long as it stays still.
WAIT = 8
CONFIGS: List[Tuple[str, Optional[str], Optional[float]]] = [("dense", None, None)] + [
    (f"{kind} {fraction}", kind, fraction) for fraction in FRACTIONS
    for kind in KINDS + ["hyper-topk"]]


class Block(nn.Module):
    """Two 3x3 convolutions with a skip; a strided 1x1 shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.shortcut = (nn.Conv2d(cin, cout, 1, stride=stride)
                         if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x)
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + skip)


class ResNetDigits(nn.Module):
    """stem 1->16, blocks 16->16, 16->32 (stride 2), 32->32, global pool, fc 32->10.

    The pixels are standardised with the training split's mean and deviation (0.305, 0.376):
    with inputs in [0, 1] and no normalisation layer, this net sat at chance for most of a
    20-epoch run even dense, and never left it when layers waited.
    """
    MEAN, STD = 0.305, 0.376

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, padding=1)
        self.blocks = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem((x.view(-1, 1, 8, 8) - self.MEAN) / self.STD))
        return self.fc(self.blocks(x).mean(dim=(2, 3)))


def build(model_name: str) -> nn.Module:
    if model_name == "mlp":
        widths = [64] + [128] * 7 + [10]
        layers: List[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers[:-1])
    else:
        model = ResNetDigits()
    # He initialisation: with PyTorch's default, eight ReLU layers start near a dead signal
    # and plain SGD takes most of the run to leave it, in every configuration alike.
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            nn.init.zeros_(m.bias)
    # Each residual branch starts at zero, so every block starts as its shortcut and the
    # stack's signal does not grow with depth (the usual practice for a ResNet without
    # normalisation layers).
    for m in model.modules():
        if isinstance(m, Block):
            nn.init.zeros_(m.conv2.weight)
    return model


def selector(kind: Optional[str], fraction: Optional[float], model: nn.Module, seed: int,
             warmup_steps: int = 0):
    if kind is None:
        return None
    if kind == "hyper":
        return hvd.LayerSelection.hyper(model, fraction=fraction, warmup_steps=warmup_steps)
    if kind == "hyper-topk":
        return hvd.LayerSelection.hyper(model, fraction=fraction, accumulate=False,
                                        warmup_steps=warmup_steps)
    if kind == "random":
        return hvd.LayerSelection.random(fraction, seed=seed, warmup_steps=warmup_steps)
    return getattr(hvd.LayerSelection, kind)(fraction, warmup_steps=warmup_steps)


def train(model_name: str, kind, fraction, seed: int, epochs: int, per_rank_batch: int,
          lr: float, warmup_steps: int = 0) -> Dict:
    """One run: test accuracy, bytes per step, step time, the selector's scoring time."""
    (x_train, y_train), (x_test, y_test) = load_digits_split(1234)
    torch.manual_seed(seed)
    model = build(model_name)
    sel = selector(kind, fraction, model, seed, warmup_steps)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   layer_selection=sel)
    scoring: List[float] = []
    if sel is not None:  # time the selector's own work inside the optimizer's step
        inner = sel.scores

        def timed(summed, _inner=inner):
            t = time.perf_counter()
            out = _inner(summed)
            scoring.append(time.perf_counter() - t)
            return out
        sel.scores = timed
    size, rank = hvd.size(), hvd.rank()
    global_batch = per_rank_batch * size
    hvd.barrier()
    sent0 = hvd.communication_stats()["bytes_sent"]
    steps, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(
            seed * 1000 + epoch))
        for start in range(0, len(order) - global_batch + 1, global_batch):
            rows = order[start + rank * per_rank_batch: start + (rank + 1) * per_rank_batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_train[rows]), y_train[rows]).backward()
            opt.step()
            steps += 1
    elapsed = time.perf_counter() - t0
    sent = hvd.communication_stats()["bytes_sent"] - sent0
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_layers = len(sel.layers) if sel is not None else None
    agreement = None
    if sel is not None:
        scores = torch.zeros(n_layers, dtype=torch.float64)
        times = []
        for i in range(200):
            t = time.perf_counter()
            hvd.allreduce(scores, op=hvd.Sum, name="bench_layers.agreement")
            times.append(time.perf_counter() - t)
        agreement = statistics.median(times)
    return {"accuracy": accuracy, "bytes_per_step": sent / steps, "steps": steps,
            "step_s": elapsed / steps, "dense_bytes": dense_bytes, "layers": n_layers,
            "scoring_s": statistics.median(scoring) if scoring else None,
            "agreement_s": agreement}


def replay(epochs: int, lr: float) -> None:
    """One process, the MLP at fraction 0.25: how often each layer travels and its longest wait.

    ``python scripts/bench_layers.py --replay``: one rank runs the same selection step (the
    agreement of one rank is its own scores), a global batch of 128 as the 4-rank runs.
    """
    (x_train, y_train), (x_test, y_test) = load_digits_split(1234)
    for kind, max_wait, accumulate in [("hyper", None, True), ("hyper", None, False),
                                       ("hyper", WAIT, False), ("norm", None, True),
                                       ("round_robin", None, True)]:
        torch.manual_seed(0)
        model = build("mlp")
        sel = (hvd.LayerSelection.hyper(model, fraction=0.25, max_wait=max_wait,
                                        accumulate=accumulate)
               if kind == "hyper" else getattr(hvd.LayerSelection, kind)(0.25))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       layer_selection=sel)
        sent, longest, steps = [0] * 8, [0] * 8, 0
        for epoch in range(epochs):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(order) - 128 + 1, 128):
                rows = order[start:start + 128]
                opt.zero_grad()
                nn.functional.cross_entropy(model(x_train[rows]), y_train[rows]).backward()
                opt.step()
                steps += 1
                for i, waited in enumerate(sel.acc.waited):
                    sent[i] += waited == 0
                    longest[i] = max(longest[i], waited)
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
        acc_label = accumulate if kind == "hyper" else "-"
        print(f"{kind:<12} max_wait={max_wait!s:<5} accumulate={acc_label!s:<5} {steps} steps  sent per layer {sent}  "
              f"longest wait {longest}  accuracy {accuracy:.1f}", flush=True)


def plot(results: Dict, models: List[str], seeds: List[int], out_dir: Path,
         prefix: str) -> List[str]:
    """Accuracy against bytes per step (one panel per model); returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    colors = {"dense": "black", "hyper": "tab:red", "hyper-topk": "tab:purple", "norm": "tab:blue",
              "round_robin": "tab:green", "random": "tab:orange"}
    for ax, model_name in zip(axes[0], models):
        dense_bytes = statistics.mean(results[model_name]["dense"][s]["bytes_per_step"]
                                      for s in seeds)
        for label, kind, fraction in CONFIGS:
            runs = [results[model_name][label][s] for s in seeds]
            x = statistics.mean(r["bytes_per_step"] for r in runs) / dense_bytes
            y = statistics.mean(r["accuracy"] for r in runs)
            err = statistics.pstdev(r["accuracy"] for r in runs)
            marker = "s" if fraction == 0.25 else ("o" if fraction == 0.5 else "*")
            ax.errorbar(x, y, yerr=err, fmt=marker, color=colors[kind or "dense"], capsize=3,
                        markersize=9 if kind is None else 7, label=label)
        ax.axvline(0.3, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{model_name}: test accuracy against bytes sent per step")
        ax.set_xlabel("bytes per step / dense (rank 0, communication_stats)")
        ax.set_ylabel(f"test accuracy, %, mean of seeds {','.join(map(str, seeds))}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    name = f"{prefix}-accuracy.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model_name in zip(axes[0], models):
        labels, steps_ms, scoring_ms, agree_ms = [], [], [], []
        for label, kind, fraction in CONFIGS:
            runs = [results[model_name][label][s] for s in seeds]
            labels.append(label)
            steps_ms.append(statistics.median(r["step_s"] for r in runs) * 1e3)
            scoring_ms.append(statistics.median(r["scoring_s"] or 0.0 for r in runs) * 1e3)
            agree_ms.append(statistics.median(r["agreement_s"] or 0.0 for r in runs) * 1e3)
        pos = range(len(labels))
        ax.bar(pos, steps_ms, color="lightgrey", label="whole step")
        ax.bar(pos, scoring_ms, color="tab:red", label="selector's scoring")
        ax.bar(pos, agree_ms, bottom=scoring_ms, color="tab:purple", label="agreement allreduce")
        ax.set_xticks(list(pos))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("ms per step (median of seeds)")
        ax.set_title(f"{model_name}: selection overhead within the step")
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    name2 = f"{prefix}-overhead.png"
    fig.savefig(out_dir / name2, dpi=110)
    plt.close(fig)
    return [name, name2]


def report(results: Dict, models: List[str], seeds: List[int], args, loads: Dict) -> str:
    """The markdown of the measured section: tables, targets, overhead."""
    settings = {"mlp": "MLP 64-128x7-10 (8 Linear layers)",
                "resnet": "ResNet-style conv net (stem, 3 residual blocks, 1x1 shortcut, fc: "
                          "9 layers)"}
    lines = ["## Accuracy and bytes per step", ""]
    for model_name in models:
        res = results[model_name]
        dense_acc = statistics.mean(res["dense"][s]["accuracy"] for s in seeds)
        dense_bytes = statistics.mean(res["dense"][s]["bytes_per_step"] for s in seeds)
        dense_step = {s: res["dense"][s]["step_s"] for s in seeds}
        r0 = res["dense"][seeds[0]]
        lines += [f"### {settings[model_name]}", "",
                  f"{hvd.size()} ranks, SGD lr {args.lr[model_name]} momentum 0.9, "
                  f"{args.batch_size} samples per rank per step, {args.epochs[model_name]} epochs "
                  f"({r0['steps']} steps), test split of 359 images (one image is 0.28 points); "
                  f"dense parameters {r0['dense_bytes']:,} bytes. Load average (1 min) before / "
                  f"after this model's runs: {loads[model_name][0]:.2f} / "
                  f"{loads[model_name][1]:.2f}."
                  + (f" Every selector with `warmup_steps={args.warmup_steps}`: all layers travel "
                     f"for the first {args.warmup_steps} steps, and those steps' bytes are in the "
                     f"means." if args.warmup_steps else ""), "",
                  "| configuration | " + " | ".join(f"seed {s}" for s in seeds)
                  + " | mean | vs dense (points) | bytes / step | bytes vs dense "
                    "| step time vs dense |",
                  "|---|" + "---:|" * (len(seeds) + 5)]
        for label, kind, fraction in CONFIGS:
            runs = {s: res[label][s] for s in seeds}
            accs = [runs[s]["accuracy"] for s in seeds]
            mean = statistics.mean(accs)
            nbytes = statistics.mean(runs[s]["bytes_per_step"] for s in seeds)
            ratio = statistics.median(runs[s]["step_s"] / dense_step[s] for s in seeds)
            lines.append(f"| {label} | " + " | ".join(f"{a:.2f}" for a in accs)
                         + f" | {mean:.2f} | {mean - dense_acc:+.2f} | {nbytes:,.0f} | "
                           f"{nbytes / dense_bytes:.3f}x | {ratio:.2f}x |")
        lines.append("")
        # The targets, plainly.
        lines += ["Targets at fraction 0.25:", ""]
        for kind in KINDS + ["hyper-topk"]:
            if f"{kind} 0.25" not in res:
                continue
            runs = [res[f"{kind} 0.25"][s] for s in seeds]
            ratio = statistics.mean(r["bytes_per_step"] for r in runs) / dense_bytes
            gap = statistics.mean(r["accuracy"] for r in runs) - dense_acc
            lines.append(f"- {kind}: bytes {ratio:.3f}x dense "
                         f"({'met' if ratio <= 0.3 else 'NOT met'}: <= 0.3x); accuracy "
                         f"{gap:+.2f} points ({'met' if gap >= -1.0 else 'NOT met'}: within 1)")
        for fraction in FRACTIONS:
            baselines = [k for k in KINDS[1:] if f"{k} {fraction}" in res]
            if not baselines:
                continue
            best = max(baselines, key=lambda k: statistics.mean(
                res[f"{k} {fraction}"][s]["accuracy"] for s in seeds))
            b_runs = [res[f"{best} {fraction}"][s] for s in seeds]
            b_acc = statistics.mean(r["accuracy"] for r in b_runs)
            b_bytes = statistics.mean(r["bytes_per_step"] for r in b_runs)
            for variant in ["hyper", "hyper-topk"]:
                if f"{variant} {fraction}" not in res:
                    continue
                hyper = [res[f"{variant} {fraction}"][s] for s in seeds]
                h_acc = statistics.mean(r["accuracy"] for r in hyper)
                h_bytes = statistics.mean(r["bytes_per_step"] for r in hyper)
                lines.append(f"- {variant} against the best baseline at fraction {fraction} "
                             f"({best}): {h_acc:.2f} vs {b_acc:.2f} % at {h_bytes:,.0f} vs "
                             f"{b_bytes:,.0f} bytes per step "
                             f"({'met' if h_acc >= b_acc else 'NOT met'})")
        lines.append("")
    lines += ["## Selection overhead per step", "",
              "Median over seeds. Scoring: the selector's scores() inside the optimizer's step "
              "(hyper: the hypernetwork's forward, backward and Adam step on this step's "
              "gradients; norm: the per-layer norms). Agreement: an allreduce of one float64 per "
              "layer, alone, median of 200. Step: the whole training step of that configuration "
              "(forward, backward, selection, reduction, optimizer). All three share the 2 cores "
              "with the other ranks and other work: compare them as ratios.", "",
              "| model | configuration | scoring ms | agreement ms | step ms | "
              "(scoring + agreement) / step | dense step ms |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for model_name in models:
        res = results[model_name]
        dense_ms = statistics.median(res["dense"][s]["step_s"] for s in seeds) * 1e3
        for label, kind, fraction in CONFIGS[1:]:
            runs = [res[label][s] for s in seeds]
            sc = statistics.median(r["scoring_s"] for r in runs) * 1e3
            ag = statistics.median(r["agreement_s"] for r in runs) * 1e3
            st = statistics.median(r["step_s"] for r in runs) * 1e3
            lines.append(f"| {model_name} | {label} | {sc:.3f} | {ag:.3f} | {st:.2f} | "
                         f"{(sc + ag) / st:.2f} | {dense_ms:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs-mlp", type=int, default=20)
    parser.add_argument("--epochs-resnet", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr-mlp", type=float, default=0.02)
    parser.add_argument("--lr-resnet", type=float, default=0.05)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "layer-selection.md"))
    parser.add_argument("--raw", default=None, help="also write every run as JSON here")
    parser.add_argument("--configs", default=None,
                        help="comma-separated configuration labels (default: all), e.g. "
                             "'dense,hyper 0.25,norm 0.25'")
    parser.add_argument("--replay", action="store_true",
                        help="one process: how often each MLP layer travels (no report)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="every selector sends all layers for this many first steps")
    parser.add_argument("--section", default="measured",
                        help="the report section (and plot name prefix) to write")
    args = parser.parse_args()
    if args.configs:
        wanted = args.configs.split(",")
        unknown = [w for w in wanted if w not in [c[0] for c in CONFIGS]]
        if unknown or "dense" not in wanted:
            parser.error(f"--configs: unknown {unknown} or no dense (known: "
                         f"{[c[0] for c in CONFIGS]})")
        CONFIGS[:] = [c for c in CONFIGS if c[0] in wanted]
    torch.set_num_threads(1)
    hvd.init()
    if args.replay:
        return replay(args.epochs_mlp, args.lr_mlp)
    models = args.models.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    args.epochs = {"mlp": args.epochs_mlp, "resnet": args.epochs_resnet}
    args.lr = {"mlp": args.lr_mlp, "resnet": args.lr_resnet}
    results: Dict = {m: {label: {} for label, _, _ in CONFIGS} for m in models}
    loads: Dict = {}
    for model_name in models:
        before = os.getloadavg()[0]
        for seed in seeds:
            # Rotate the order per seed: interleaved contenders share the load's bursts.
            shift = (seed * 4) % len(CONFIGS)
            for label, kind, fraction in CONFIGS[shift:] + CONFIGS[:shift]:
                r = train(model_name, kind, fraction, seed, args.epochs[model_name],
                          args.batch_size, args.lr[model_name], args.warmup_steps)
                results[model_name][label][seed] = r
                if hvd.rank() == 0:
                    print(f"{model_name:<6} seed {seed} {label:<18} acc {r['accuracy']:6.2f}  "
                          f"bytes/step {r['bytes_per_step']:10,.0f}  "
                          f"step {r['step_s'] * 1e3:7.2f} ms  load {os.getloadavg()[0]:.2f}",
                          flush=True)
        loads[model_name] = (before, os.getloadavg()[0])
    if hvd.rank() != 0:
        return
    if args.raw:
        Path(args.raw).write_text(json.dumps({"results": results, "loads": loads}, indent=1))
    out = Path(args.out)
    names = plot(results, models, seeds, out.parent,
                 "layer-selection" if args.section == "measured"
                 else f"layer-selection-{args.section}")
    command = "mpiexec -n {} python scripts/bench_layers.py".format(hvd.size()) + "".join(
        f" {flag} {value}" for flag, value, default in [
            ("--models", args.models, "mlp,resnet"), ("--seeds", args.seeds, "0,1,2"),
            ("--epochs-mlp", args.epochs_mlp, 20), ("--epochs-resnet", args.epochs_resnet, 40),
            ("--configs", repr(args.configs), repr(None)),
            ("--warmup-steps", args.warmup_steps, 0), ("--section", args.section, "measured")]
        if value != default)
    head = [f"Command: `{command}` (wrote this section and "
            + ", ".join(f"[{n}]({n})" for n in names) + "). Machine: x86_64, "
            f"{os.cpu_count()} cores shared with other work; one thread per rank.", "",
            f"![accuracy against bytes]({names[0]})", "",
            f"![selection overhead]({names[1]})", ""]
    text = "\n".join(head) + report(results, models, seeds, args, loads)
    write_section(out, args.section, text)
    print(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
