"""Train an MLP on scikit-learn's bundled digits with fusionring's parameter server.

    fusionrun -np 3 python examples/train_ps.py                 # 1 server, 2 workers, adaptive sync
    mpiexec -n 5 python examples/train_ps.py --sync ssp --staleness 2 --slow-delay-ms 20

Rank 0 serves (it stays inside ps.init() until the workers are done); every other rank is a worker and trains on
its shard of the training set. ``--slow-delay-ms`` makes the last worker a straggler (it sleeps that long per step).
Worker 0 prints the test accuracy after each of its epochs; ``--log PATH`` also writes one JSON line per epoch
(seconds since the start, accuracy) for the benchmark.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusionring.torch as hvd
from fusionring import ps
from fusionring.datasets import load_digits_split


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", default="adaptive", choices=["bsp", "asp", "ssp", "adaptive"])
    parser.add_argument("--staleness", type=int, default=3)
    parser.add_argument("--slack", type=float, default=None)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--fp16", action="store_true", help="gradients travel as float16")
    parser.add_argument("--slow-delay-ms", type=float, default=0.0, help="the last worker sleeps this per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()

    ps.init(num_servers=args.servers)  # server ranks serve here and exit when the workers are done
    k, workers = ps.worker_rank(), ps.num_workers()
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    x_shard, y_shard = x_train[k::workers], y_train[k::workers]
    model = build_model(args.hidden)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                  named_parameters=model.named_parameters(), sync=args.sync,
                                  staleness=args.staleness, slack=args.slack, compression=compression)
    slow = args.slow_delay_ms / 1000.0 if k == workers - 1 else 0.0
    log = open(args.log, "w") if args.log and k == 0 else None
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed + k)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        for i in range(0, len(order), args.batch_size):
            idx = order[i:i + args.batch_size]
            if slow:
                time.sleep(slow)
            opt.zero_grad()
            F.cross_entropy(model(x_shard[idx]), y_shard[idx]).backward()
            opt.step()
        opt.end_epoch()
        if k == 0:
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
            elapsed = time.perf_counter() - start
            print(f"epoch {epoch + 1}: test accuracy {accuracy:.4f} after {elapsed:.2f} s", flush=True)
            if log:
                log.write(json.dumps({"epoch": epoch + 1, "seconds": elapsed, "accuracy": accuracy}) + "\n")
                log.flush()
    stats = ps.stats()
    ps.shutdown()
    if k == 0:
        print(f"worker 0: {stats['pushes']} pushes, {stats['waits']} held back, staleness max "
              f"{stats['staleness_max']} mean {stats['staleness_mean']:.2f}, sent {stats['bytes_sent']} B, "
              f"received {stats['bytes_received']} B, sync-group changes {len(stats['group_changes'])}")


if __name__ == "__main__":
    main()
