"""Rendering a benchmark run: tables, plots and the markdown page (its hand-written findings
kept when it is rendered again)."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

from .driver import LinkRun, summarize_collectives, summarize_training
from .util import MIB, REPO_ROOT, markdown_table, preserved_section, ring_bytes


# ----------------------------------------------------------------------------- rendering

def _fmt(value: Optional[float], spec: str, scale: float = 1.0, missing: str = "–") -> str:
    return missing if value is None else format(value / scale, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return markdown_table(header, rows, align="-" * len(header))


def training_table(run: LinkRun, target: float, reference: str = "fusionring") -> str:
    rows = summarize_training(run, target)
    ref = next((r["step_seconds"] for r in rows if r["name"] == reference), None)
    header = ["contender", "step time ms (median [min–max])", "samples/s", f"speed vs `{reference}`",
              "sent MB/step/rank (counted)", "wire MB/step/rank", "link time ms",
              f"steps to {target:.0%}", f"s to {target:.0%}", "test acc (at step)"]
    body = []
    for r in rows:
        tta = r["tta"]
        body.append([
            f"`{r['name']}`",
            f"{_fmt(r['step_seconds'], '.0f', 1e-3)} [{_fmt(r['step_seconds_min'], '.0f', 1e-3)}–"
            f"{_fmt(r['step_seconds_max'], '.0f', 1e-3)}]",
            _fmt(r["samples_per_s"], ".0f"),
            f"{ref / r['step_seconds']:.2f}×" if ref and r["step_seconds"] else "–",
            _fmt(r["bytes_per_step"], ".2f", 1e6),
            _fmt(r["wire_bytes_per_step"], ".2f", 1e6),
            _fmt(r["link_seconds"], ".0f", 1e-3),
            str(tta["steps"]) if tta else "not reached",
            f"{tta['seconds']:.1f}" if tta else "–",
            f"{_fmt(r['final_accuracy'], '.1%')} ({r['steps']})",
        ])
    return _table(header, body)


def collectives_table(run: LinkRun) -> str:
    rows = summarize_collectives(run)
    header = ["method", "median s", "best s", "bus bandwidth Gbit/s", "of link rate", "wire MiB/rank"]
    body = [[f"`{r['name']}`", _fmt(r["seconds"], ".3f"), _fmt(r["seconds_min"], ".3f"),
             _fmt(r["busbw_bits_per_s"], ".3f", 1e9), _fmt(r["link_fraction"], ".1%"),
             _fmt(r["wire_bytes"], ".1f", MIB)] for r in rows]
    return _table(header, body)


def _legend_labels(runs: Sequence[LinkRun]) -> List[str]:
    """The runs' link labels, numbered where one link appears more than once."""
    labels = [run.label for run in runs]
    return [label if labels.count(label) == 1 else f"{label} ({labels[:i + 1].count(label)})"
            for i, label in enumerate(labels)]


def plot_runs(runs: Sequence[LinkRun], target: float, doc_dir: Path, name: str) -> List[str]:
    """Write the PNGs (step time, accuracy over time, collective bandwidth); return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    trained = [run for run in runs if "training" in run.result]
    if trained:
        names = list(trained[0].result["training"]["contenders"])
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(trained)
        for i, (run, legend) in enumerate(zip(trained, _legend_labels(trained))):
            by_name = {r["name"]: r for r in summarize_training(run, target)}
            values = [by_name[n]["step_seconds"] * 1e3 if n in by_name else 0 for n in names]
            xs = [x + i * width for x in range(len(names))]
            ax.bar(xs, values, width, label=legend)
            bound = [(x, by_name[n]["link_seconds"] * 1e3) for x, n in zip(xs, names)
                     if n in by_name and by_name[n]["link_seconds"] is not None]
            if bound:
                ax.scatter([b[0] for b in bound], [b[1] for b in bound], marker="_", s=400 * width,
                           color="black", linewidths=2, zorder=3,
                           label="bytes per step ÷ link rate" if i == 0 else None)
        ax.set_xticks([x + width * (len(trained) - 1) / 2 for x in range(len(names))])
        ax.set_xticklabels(names, rotation=20, ha="right")
        ax.set_ylabel("step time, ms (median)")
        ax.set_title(f"{trained[0].result['ranks']} ranks, {trained[0].result['model']['parameters'] / 1e6:.1f}M "
                     f"parameters")
        ax.legend()
        fig.tight_layout()
        file = f"{name}-step-time.png"
        fig.savefig(doc_dir / file, dpi=110)
        plt.close(fig)
        written.append(file)

        fig, axes = plt.subplots(1, len(trained), figsize=(6 * len(trained), 4), squeeze=False)
        for ax, run, legend in zip(axes[0], trained, _legend_labels(trained)):
            for contender, data in run.result["training"]["contenders"].items():
                points = [p for p in data["history"] if p["accuracy"] is not None]
                ax.plot([p["seconds"] for p in points], [p["accuracy"] for p in points], marker=".",
                        label=contender)
            ax.axhline(target, color="grey", linestyle="--", linewidth=1)
            ax.set_xlabel("training time, s (timed steps only)")
            ax.set_ylabel("test accuracy")
            ax.set_title(legend)
            ax.set_ylim(0, 1)
            ax.legend(fontsize=8)
        fig.tight_layout()
        file = f"{name}-accuracy.png"
        fig.savefig(doc_dir / file, dpi=110)
        plt.close(fig)
        written.append(file)

    measured = [run for run in runs if "collectives" in run.result]
    if measured:
        methods = list(measured[0].result["collectives"]["methods"])
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(measured)
        with_rate = all(run.rate_bits_per_s for run in measured)
        for i, (run, legend) in enumerate(zip(measured, _legend_labels(measured))):
            by_name = {r["name"]: r for r in summarize_collectives(run)}
            key = "link_fraction" if with_rate else "busbw_bits_per_s"
            scale = 100 if with_rate else 1e-9
            values = [(by_name[m][key] or 0) * scale for m in methods]
            ax.bar([x + i * width for x in range(len(methods))], values, width, label=legend)
        if with_rate:
            ax.axhline(100, color="grey", linestyle="--", linewidth=1)
            ax.axhline(100 * 1448 / 1514, color="grey", linestyle=":", linewidth=1,
                       label="TCP payload ceiling (1448/1514)")
            ax.set_ylim(0, 120)
            ax.set_ylabel("bus bandwidth, % of link rate")
        else:
            ax.set_ylabel("bus bandwidth, Gbit/s")
        ax.set_xticks([x + width * (len(measured) - 1) / 2 for x in range(len(methods))])
        ax.set_xticklabels(methods)
        mib = measured[0].result["collectives"]["bytes"] / MIB
        ax.set_title(f"allreduce of {mib:.0f} MiB fp32, {measured[0].result['ranks']} ranks")
        ax.legend(loc="upper center", ncol=3, fontsize=8)
        fig.tight_layout()
        file = f"{name}-collectives.png"
        fig.savefig(doc_dir / file, dpi=110)
        plt.close(fig)
        written.append(file)
    return written


def _git_revision() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return f"{sha} (with uncommitted changes)" if dirty else sha or "unknown"


FINDINGS_START, FINDINGS_END = "<!-- findings: kept when the page is rendered again -->", "<!-- /findings -->"


def kept_findings(page: Path) -> Optional[str]:
    """The hand-written block between the findings markers of an existing page, markers included."""
    return preserved_section(str(page), markers=(FINDINGS_START, FINDINGS_END))


def render_markdown(runs: Sequence[LinkRun], target: float, images: Sequence[str], name: str,
                    rendered_by: Optional[str] = None, findings: Optional[str] = None) -> str:
    """The benchmark page: setup, the exact commands, one section per run, plots, notes.

    ``findings`` (a block from :func:`kept_findings`) goes right after the commands."""
    first = next((run.result for run in runs if "training" in run.result), runs[0].result)
    commands = list(dict.fromkeys(run.command for run in runs if run.command))
    lines = [f"# Benchmark `{name}`: fusionring against DDP (gloo) and MPI", ""]
    lines += ["Made with (from the repository root, as root for `--cluster`):", "", "```"] + commands + ["```", ""]
    if rendered_by:
        lines += ["and this page rendered from their saved results with:", "", "```", rendered_by, "```", ""]
    if findings:
        lines += [findings, ""]
    lines.append(f"{datetime.date.today().isoformat()}, commit {_git_revision()}, {os.cpu_count()} cores, "
                 f"{first['ranks']} ranks, torch {first['torch']}, {first['mpi_library']}.")
    lines.append("")
    lines.append("Load on the machine (`uptime`) before and after each launch; other work ran on it at the "
                 "same time, so absolute numbers are noisy — compare contenders within one run, which ran "
                 "interleaved in the same job:")
    lines.append("")
    for run in runs:
        lines.append(f"- {run.heading}: before `{run.uptime_before}`; after `{run.uptime_after}`")
    lines.append("")
    if "model" in first:
        model, training = first["model"], first["training"]
        lines += [
            "## Setup", "",
            f"- Model: MLP 64 → {model['hidden']} × {model['depth']} → 10 (ReLU), {model['parameters']:,} "
            f"parameters, {model['gradient_bytes'] / 1e6:.1f} MB of fp32 gradients per step.",
            f"- Data: scikit-learn digits, {model['train_samples']} train / {model['test_samples']} test images; "
            f"{model['batch_size']} per rank per step; SGD lr {model['lr']}, momentum {model['momentum']} "
            f"for every contender, every contender starting from the same weights and seeing the same "
            f"batches.",
            f"- Interleaving: {training['warmup']} warm-up steps each, then {training['repeats']} rounds; in "
            f"each round every contender trains {training['steps_per_turn']} steps (one turn), in an order "
            f"rotated every round. Step time = barrier-to-barrier time of a turn / its steps, slowest "
            f"rank; the table gives the median over turns and the range. Test accuracy is evaluated "
            f"after warm-up and after every turn (untimed); time to accuracy counts timed steps only "
            f"(warm-up included).",
            "- Sent MB/step/rank (counted): fusionring — `hvd.communication_stats()['bytes_sent']` delta; "
            "DDP — every tensor its communication hook passes to `all_reduce` × 2(N−1)/N; MPI — the "
            "flattened gradients × 2(N−1)/N. Wire MB: the rank's interface transmit counter "
            "(`/proc/net/dev` in its namespace; frames with headers, acknowledgements and negotiation "
            "included), only where each rank has its own interface.",
            "- Link time: wire bytes (counted bytes where there is no per-rank interface) ÷ link rate, the "
            "step's lower bound on communication; when the step time is far above it, the link is not what "
            "limits the step.",
            "- fusionring's runtime is started for each of its turns and stopped after (its background loop "
            "negotiates every cycle even when idle and would otherwise take CPU from the peers); the restart's "
            "first, uncached negotiation is inside the timed turn.",
            "",
            "| contender | what it runs |", "| --- | --- |",
        ]
        lines += [f"| `{n}` | {d['description']} |" for n, d in training["contenders"].items()]
        for n, reason in training.get("skipped", {}).items():
            lines.append(f"| `{n}` | skipped: {reason} |")
        lines.append("")
    for run in runs:
        lines += [f"## {run.heading}", ""]
        if run.rate_bits_per_s:
            lines.append(f"Emulated cluster: {run.result['ranks']} network namespaces, every link shaped to "
                         f"{run.label} each way (see `docs/cluster.md`); interface `{run.result['interface']}`, "
                         f"rank 0 at {run.result['master_address']}.")
        else:
            lines.append(f"All ranks on this machine over `{run.result['interface']}` (no emulated links).")
        lines += ["", "Launch:", "", "```", run.launch, "```", ""]
        if "collectives" in run.result:
            coll = run.result["collectives"]
            size = run.result["ranks"]
            lines.append(f"### Raw allreduce: {coll['bytes'] / MIB:.0f} MiB fp32, sum, median of "
                         f"{coll['repeats']}")
            lines.append("")
            lines.append(collectives_table(run))
            lines.append("")
            limit = ""
            if run.rate_bits_per_s:
                floor = ring_bytes(coll["bytes"], size) * 8 / run.rate_bits_per_s
                limit = (f" At {run.label} no allreduce can take less than 2(N−1)/N × bytes ÷ rate = "
                         f"{floor:.3f} s (100%); TCP/IP headers cap payload at about 95.6% of a shaped link "
                         f"(1448 of 1514 bytes per frame).")
            lines.append(f"Bus bandwidth = 2(N−1)/N × bytes ÷ time (the rate each link carries).{limit}")
            lines.append("")
            lines += _collective_notes(run)
        if "training" in run.result:
            lines.append(f"### Training, {run.result['ranks']} ranks")
            lines.append("")
            lines.append(training_table(run, target))
            lines.append("")
            lines += _training_notes(run, target)
    if images:
        lines += ["## Plots", ""]
        lines += [f"![{image}]({image})" for image in images]
        lines.append("")
    return "\n".join(lines)


def _collective_notes(run: LinkRun) -> List[str]:
    """Sentences the collective table implies: how close to the link, and whether the CPU limits."""
    if not run.rate_bits_per_s:
        return []
    rows = {r["name"]: r for r in summarize_collectives(run)}
    notes = []
    core = rows.get("fusionring-core")
    if core and core["seconds"]:
        best = ring_bytes(run.result["collectives"]["bytes"], run.result["ranks"]) * 8 / core["seconds_min"]
        notes.append(f"fusionring's ring (core) reaches {core['link_fraction']:.1%} of the link rate at the "
                     f"median, {best / run.rate_bits_per_s:.1%} at best.")
    fractions = [r["link_fraction"] for r in rows.values() if r["link_fraction"]]
    if fractions and max(fractions) < 0.8:
        cores = os.cpu_count()
        notes.append(f"No method reaches 80% of the link rate: at {run.label} the ranks' CPUs ({run.result['ranks']} "
                     f"ranks on {cores} cores, which also run the kernel's packet processing and the "
                     f"reductions) are the limit, not the links.")
    return [" ".join(notes), ""] if notes else []


def _training_notes(run: LinkRun, target: float) -> List[str]:
    """Sentences the training table implies: counters that disagree, steps far above the link bound."""
    notes = []
    for r in summarize_training(run, target):
        sent, wire = r["bytes_per_step"], r["wire_bytes_per_step"]
        # small volumes differ by acknowledgements and negotiation alone: flag only large gaps
        if sent and wire and abs(wire - sent) > max(0.1 * max(wire, sent), 1e6):
            notes.append(f"`{r['name']}`: the counted bytes ({sent / 1e6:.2f} MB) and the interface counter "
                         f"({wire / 1e6:.2f} MB) disagree; the interface counter is what went on the wire.")
    if run.rate_bits_per_s:
        bound = [r for r in summarize_training(run, target)
                 if r["link_seconds"] is not None and r["step_seconds"] and r["link_seconds"] > 0.001]
        share = [r["link_seconds"] / r["step_seconds"] for r in bound]
        if share and max(share) < 0.35:
            notes.append(f"At {run.label} the link time is at most {max(share):.0%} of any step: compute and "
                         f"the CPU cost of communicating (copies, reductions, conversions, packet processing "
                         f"for {run.result['ranks']} ranks on {os.cpu_count()} cores) set the step time, "
                         f"not the link.")
    return ["\n".join(f"- {n}" for n in notes), ""] if notes else []


def print_summary(runs: Sequence[LinkRun], target: float) -> None:
    for run in runs:
        print(f"\n== {run.label} ({run.result['ranks']} ranks)")
        if "collectives" in run.result:
            print(collectives_table(run))
        if "training" in run.result:
            print(training_table(run, target))
            skipped = run.result["training"].get("skipped")
            if skipped:
                print("skipped: " + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
