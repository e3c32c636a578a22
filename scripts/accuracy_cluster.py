"""Test accuracy of cluster-and-hash gradient quantization on the digits MLP, against dense.

    mpiexec -n 4 python scripts/accuracy_cluster.py   # writes the accuracy section of
                                                      # docs/benchmarks/cluster-quant.md

The same training as scripts/accuracy_nm.py (MLP 64-256-256-10 on scikit-learn's digits,
hvd.DistributedOptimizer, SGD with momentum 0.9, one fusion group, each rank a quarter of every
global batch), with Compression.cluster in place of N:M. Rank 0 writes the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import fusionring.torch as hvd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import accuracy_nm  # noqa: E402
from bench_nm import write_section  # noqa: E402

CONFIGS = [
    ("dense (no compression)", None),
    ("cluster K=16, EF (default)", dict(k=16)),
    ("cluster K=16, no EF", dict(k=16, error_feedback=False)),
    ("cluster K=4, EF", dict(k=4)),
    ("cluster K=4, no EF", dict(k=4, error_feedback=False)),
    ("cluster K=16, 64 scored buckets, EF", dict(k=16, buckets=64)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "cluster-quant.md"))
    args = parser.parse_args()
    hvd.init()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for label, kwargs in CONFIGS:
        t0 = time.perf_counter()
        results = [accuracy_nm.train(kwargs, seed, args.epochs, args.batch_size, args.lr,
                                     method=hvd.Compression.cluster) for seed in seeds]
        accs = [r[0] for r in results]
        rows.append((label, accs, results[0][1], results[0][2]))
        if hvd.rank() == 0:
            print(f"{label:<36} " + " ".join(f"{a:6.2f}" for a in accs)
                  + f"  mean {statistics.mean(accs):6.2f}  payload/dense {results[0][1]:.4f}"
                  f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    if hvd.rank() != 0:
        return
    dense = statistics.mean(rows[0][1])
    command = f"mpiexec -n {hvd.size()} python scripts/accuracy_cluster.py" + (
        "" if args.seeds == "0,1,2" else f" --seeds {args.seeds}") + (
        "" if args.epochs == 30 else f" --epochs {args.epochs}")
    lines = [
        "## Accuracy on the digits MLP", "",
        f"Command: `{command}`. {hvd.size()} ranks, MLP 64-256-256-10, SGD lr {args.lr} "
        f"momentum 0.9, {args.batch_size} samples per rank per step, {args.epochs} epochs "
        f"({rows[0][3]} steps), test split of 360 images; seeds {', '.join(map(str, seeds))}. "
        "Payload/dense = the bytes of the ring's payloads over the dense float32 bytes of the "
        "buffer (each rank sends about 2(P-1)/P of either).", "",
        "| configuration | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean | vs dense (points) | payload / dense |",
        "|---|" + "---:|" * (len(seeds) + 3)]
    for label, accs, ratio, _ in rows:
        mean = statistics.mean(accs)
        lines.append(f"| {label} | " + " | ".join(f"{a:.2f}" for a in accs)
                     + f" | {mean:.2f} | {mean - dense:+.2f} | {ratio:.4f} |")
    k16 = statistics.mean(rows[1][1])
    met = "met" if dense - k16 <= 0.5 else "not met"
    lines += ["", f"Target K=16 with error feedback within 0.5 points of dense: "
              f"{k16 - dense:+.2f} points, **{met}**.", ""]
    out = Path(args.out)
    if not out.exists():
        out.write_text("# Cluster-and-hash quantization: measurements\n\n")
    write_section(out, "accuracy", "\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
