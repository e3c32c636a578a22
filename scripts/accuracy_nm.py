"""Test accuracy of N:M gradient sparsification on the digits MLP, against dense training.

    mpiexec -n 4 python scripts/accuracy_nm.py      # writes the accuracy section of
                                                    # docs/benchmarks/nm.md

Every configuration trains the same MLP (64-256-256-10) on scikit-learn's digits with
hvd.DistributedOptimizer (SGD, momentum 0.9), the same data order and initialisation per
seed; each rank takes its quarter of every global batch. All gradients form one fusion group
(`groups=1`), so the fused layout, and with it every rounding and N:M group, is the same in every
run: the numbers reproduce exactly. Rank 0 evaluates the held-out split (the model is identical on
every rank) and writes the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import fusionring.torch as hvd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_nm import write_section  # noqa: E402

CONFIGS = [
    ("dense (no compression)", None),
    ("2:4 shared mask, EF", dict(n=2, m=4)),
    ("2:4 shared mask, no EF", dict(n=2, m=4, error_feedback=False)),
    ("2:4 per-rank masks, EF", dict(n=2, m=4, shared_mask=False)),
    ("2:4 per-rank masks, no EF", dict(n=2, m=4, shared_mask=False, error_feedback=False)),
    ("2:4 float16 shared mask, EF", dict(n=2, m=4, values=torch.float16)),
    ("1:4 shared mask, EF", dict(n=1, m=4)),
    ("1:4 per-rank masks, EF", dict(n=1, m=4, shared_mask=False)),
    ("schedule 4:4 -> 2:4 -> 1:4", dict(n=1, m=4, schedule=[(0, (4, 4)), (50, (2, 4)),
                                                            (150, (1, 4))])),
    ("adaptive (4:4 / 2:4 / 1:4)", dict(n=1, m=4, schedule="adaptive")),
]


def load(seed: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    split = int(0.8 * len(x))
    return x[order[:split]], y[order[:split]], x[order[split:]], y[order[split:]]


def train(kwargs, seed: int, epochs: int, per_rank_batch: int, lr: float, method=None):
    """Accuracy, payload/dense ratio and steps of one run; `method` builds the compressor from
    `kwargs` (default Compression.nm; None kwargs: dense)."""
    x_train, y_train, x_test, y_test = load(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    method = method or hvd.Compression.nm
    compression = hvd.Compression.none if kwargs is None else method(**kwargs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, groups=1)
    size, rank = hvd.size(), hvd.rank()
    global_batch = per_rank_batch * size
    steps = 0
    for epoch in range(epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed * 1000
                                                                                     + epoch))
        for start in range(0, len(order) - global_batch + 1, global_batch):
            rows = order[start + rank * per_rank_batch: start + (rank + 1) * per_rank_batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_train[rows]), y_train[rows]).backward()
            opt.step()
            steps += 1
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    stats = getattr(compression, "stats", None)
    ratio = stats["payload_bytes"] / stats["dense_bytes"] if stats and stats["dense_bytes"] else 1.0
    return accuracy, ratio, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "nm.md"))
    args = parser.parse_args()
    hvd.init()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for label, kwargs in CONFIGS:
        t0 = time.perf_counter()
        results = [train(kwargs, seed, args.epochs, args.batch_size, args.lr) for seed in seeds]
        accs = [r[0] for r in results]
        rows.append((label, accs, results[0][1], results[0][2]))
        if hvd.rank() == 0:
            print(f"{label:<32} " + " ".join(f"{a:6.2f}" for a in accs)
                  + f"  mean {statistics.mean(accs):6.2f}  payload/dense {results[0][1]:.3f}"
                  f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    if hvd.rank() != 0:
        return
    dense = statistics.mean(rows[0][1])
    command = f"mpiexec -n {hvd.size()} python scripts/accuracy_nm.py" + (
        "" if args.seeds == "0,1,2" else f" --seeds {args.seeds}") + (
        "" if args.epochs == 30 else f" --epochs {args.epochs}")
    lines = [
        "## Accuracy on the digits MLP",
        "",
        f"Command: `{command}`. {hvd.size()} ranks, MLP 64-256-256-10, SGD lr {args.lr} "
        f"momentum 0.9, {args.batch_size} samples per rank per step, {args.epochs} epochs "
        f"({rows[0][3]} steps), test split of 360 images; seeds {', '.join(map(str, seeds))} "
        "(initialisation and data order); one fusion group, so reruns give the same numbers. Payload/dense = bytes the compressor put in its "
        "payloads over the dense float32 bytes (per-rank masks: values + mask of one rank's "
        "buffer; the ring moves about 2(P-1)/P of either).",
        "",
        "| configuration | " + " | ".join(f"seed {s}" for s in seeds)
        + " | mean | vs dense (points) | payload / dense |",
        "|---|" + "---:|" * (len(seeds) + 3),
    ]
    for label, accs, ratio, _ in rows:
        mean = statistics.mean(accs)
        lines.append(f"| {label} | " + " | ".join(f"{a:.2f}" for a in accs)
                     + f" | {mean:.2f} | {mean - dense:+.2f} | {ratio:.3f} |")
    write_section(Path(args.out), "accuracy", "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
