"""Synthetic training throughput, written as an ordinary Horovod script.

    fusionrun -np 4 python examples/synthetic_benchmark.py
    fusionrun -np 4 python examples/synthetic_benchmark.py --fp16-allreduce
    fusionrun -np 4 python examples/synthetic_benchmark.py --use-adasum

On a machine with GPUs each rank trains on the GPU of its local rank (``--no-cuda`` stays on
the CPU).

Random images and labels stay fixed, so only the step itself is timed: forward, backward,
gradient allreduce and update. Rank 0 prints images/s per rank for each timed iteration,
their mean and a 95% interval, and the total over all ranks. Only the import differs from a
Horovod script.
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusionring.torch as hvd  # was: import horovod.torch as hvd


def conv_net(classes: int) -> nn.Module:
    """A small VGG-style net: enough layers to make fusion matter, quick on a CPU."""
    layers, width = [], 3
    for out in (32, 32, 64, 64, 128):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        if out != width:
            layers.append(nn.MaxPool2d(2))
        width = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="gradients travel as float16")
    parser.add_argument("--use-adasum", action="store_true", help="combine updates with Adasum")
    parser.add_argument("--no-cuda", action="store_true",
                        help="stay on the CPU even where a GPU is present")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: init() fits them to the cores)")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:  # one GPU per rank; its tensors are reduced on it, over NCCL where it loads
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if cuda else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = conv_net(args.classes).to(device)
    # Adasum combines updates without averaging them, so the learning rate is not scaled.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler, momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.classes, (args.batch_size,), device=device)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: conv net, {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"batch size {args.batch_size} per rank; {hvd.size()} ranks on {device.type}; "
        f"{'Adasum' if args.use_adasum else 'Average'}"
        f"{', fp16 allreduce' if args.fp16_allreduce else ''}")
    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{i}: {rates[-1]:.1f} img/sec per rank")
    mean, spread = float(np.mean(rates)), 1.96 * float(np.std(rates))
    log(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {hvd.size()} ranks: {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")

    # Every rank must end with the same weights; a disagreement here is a bug, not noise.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="synthetic.final_weights")
    log(f"Largest weight difference between ranks: {(gathered - gathered[0]).abs().max().item():g}")


if __name__ == "__main__":
    main()
