"""Train an MLP on scikit-learn's bundled digits data with fusionring.

    fusionrun -np 4 python examples/train.py

Each rank trains on its shard of every global batch; gradients are averaged by
fusionring's DistributedOptimizer, fused in balanced groups from a grouping plan (made
on the first run and reused). Rank 0 prints progress, samples/s, test accuracy and the
bytes it communicated.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusionring.torch as hvd
from fusionring.datasets import load_digits_split
from fusionring.plan import Plan, make_plan


def build_model(hidden: int, depth: int) -> nn.Module:
    layers, width = [], 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def compression_from(name: str):
    if name == "none":
        return hvd.Compression.none
    if name == "fp16":
        return hvd.Compression.fp16
    if name.startswith("nm"):
        if not hasattr(hvd.Compression, "nm"):
            raise SystemExit("this build has no N:M compression")
        n, m = (int(v) for v in name[2:].split(":")) if ":" in name else (2, 4)
        return hvd.Compression.nm(n=n, m=m)
    raise SystemExit(f"unknown compression {name!r}")


def grouping_plan(model: nn.Module, args) -> Plan | str | None:
    """Load the plan, or make it on rank 0 and share it (every rank must use the same);
    "auto" lets the optimizer make its groups from the first step."""
    if args.plan in ("none", "auto"):
        return None if args.plan == "none" else "auto"
    plan = None
    if hvd.rank() == 0:
        if os.path.exists(args.plan):
            plan = Plan.load(args.plan)
            try:
                plan.check_model(model)
            except ValueError:
                plan = None  # the model changed: make a new plan
        if plan is None:
            plan = make_plan(build_model(args.hidden, args.depth), torch.randn(args.batch_size, 64),
                             world_size=hvd.size())
            os.makedirs(os.path.dirname(os.path.abspath(args.plan)), exist_ok=True)
            plan.save(args.plan)
            print(f"made grouping plan {args.plan}: {len(plan.groups)} groups", flush=True)
    return Plan.load(hvd.broadcast_object(plan.to_dict() if plan else None, root_rank=0))


def progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, leave=False, file=sys.stdout)
    except ImportError:
        return iterable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by size")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", default="none", help="none, fp16 or nm2:4")
    parser.add_argument("--plan", default=os.path.join("plans", "digits-mlp.json"),
                        help="grouping plan path (made if missing), 'auto' (groups learned in "
                             "the first step) or 'none'")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    hvd.init()  # also fits torch's threads to this rank's share of the cores
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    model = build_model(args.hidden, args.depth)
    plan = grouping_plan(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression_from(args.compression),
                                         grouping_plan=plan)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    global_batch = args.batch_size * hvd.size()
    steps_per_epoch = len(x_train) // global_batch
    show = hvd.rank() == 0 and not args.quiet
    sent_before = hvd.communication_stats()["bytes_sent"]
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        model.train()
        for step in progress(range(steps_per_epoch), show, f"epoch {epoch + 1}/{args.epochs}"):
            batch = order[step * global_batch:(step + 1) * global_batch]
            mine = batch[hvd.rank()::hvd.size()]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
            loss.backward()
            optimizer.step()
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    sent = hvd.communication_stats()["bytes_sent"] - sent_before
    samples_per_s = steps_per_epoch * global_batch * args.epochs / elapsed
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} epochs={args.epochs} compression={args.compression} "
              f"plan={plan if plan is None or isinstance(plan, str) else f'{len(plan.groups)} groups'}")
        print(f"samples/s={samples_per_s:.0f} test_accuracy={accuracy * 100:.2f}% "
              f"bytes_sent_per_rank={sent / 1e6:.1f} MB time={elapsed:.1f}s", flush=True)


if __name__ == "__main__":
    main()
