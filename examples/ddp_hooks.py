"""Train an MLP on scikit-learn's digits with plain PyTorch DDP and a fusionring hook.

    torchrun --nproc_per_node 2 examples/ddp_hooks.py
    mpiexec -n 2 python examples/ddp_hooks.py            # ranks from MPI, gloo over 127.0.0.1
    torchrun --nproc_per_node 2 examples/ddp_hooks.py --hook layers
    torchrun --nproc_per_node 2 examples/ddp_hooks.py --hook cluster

DDP stays DDP (gloo here); only its communication hook changes. `--hook nm` (default): every
bucket travels as 2 of every 4 values in float16 (a quarter of the bytes). `--hook cluster`:
every bucket travels as `--k` cluster ids per value (4 bits at k=16) and a small codebook, from
each rank's own clustering. `--hook layers`:
each step the ranks agree on the layers with the largest accumulated gradient norm
(`--fraction` of them) and only those travel. Either way what is not sent is held back by
error feedback, and the hook's state is saved and restored with the rest of the checkpoint.
"""
from __future__ import annotations

import argparse
import io
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from fusionring.datasets import load_digits_split
from fusionring.ddp import hooks
from fusionring.selection import LayerSelection


def init_distributed(port: int) -> Optional[dist.TCPStore]:
    """torchrun sets RANK/WORLD_SIZE/MASTER_*; under mpiexec take rank and size from MPI.

    Under mpiexec rank 0 hosts the rendezvous store, and it is returned so that rank 0 can
    outlast every peer's use of it (see finish_distributed); torchrun's agent hosts its own.
    """
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        return None
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
            break
    else:
        rank, size = 0, 1
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ.get("MASTER_PORT", port)), size, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    return store


def finish_distributed(store: Optional[dist.TCPStore]) -> None:
    """Tear the group down; the rank hosting the store leaves last.

    A rank that destroys its group (or exits, taking the store's server with it) while a peer
    still uses them can abort that peer at exit ("terminate called without an active
    exception"), so every rank first passes a barrier, and the store's host then waits until
    every rank has said, through the store, that it is done with the group.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    if store is None:
        return
    store.add("done", 1)
    # Bounded: a peer that died after the barrier must not keep rank 0 here for ever.
    deadline = time.monotonic() + 60.0
    while rank == 0 and store.add("done", 0) < size and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=["nm", "cluster", "layers"], default="nm",
                        help="N:M sparsification or cluster quantization of every bucket, or whole "
                             "layers chosen per step")
    parser.add_argument("--k", type=int, default=16, help="--hook cluster: clusters per bucket")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--per-rank-masks", action="store_true",
                        help="select on each rank's own gradients (allgather) instead of a shared mask")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="--hook layers: the share of layers sent each step")
    parser.add_argument("--port", type=int, default=29517, help="rendezvous port under mpiexec")
    args = parser.parse_args()

    store = init_distributed(args.port)
    rank, size = dist.get_rank(), dist.get_world_size()
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=0.1)   # several buckets, to show they are handled
    if args.hook == "nm":
        state = hooks.NMState(process_group=None, n=args.n, m=args.m, values=torch.float16,
                              shared_mask=not args.per_rank_masks)
        ddp.register_comm_hook(state, hooks.nm_hook)
    elif args.hook == "cluster":
        state = hooks.ClusterState(process_group=None, k=args.k)
        ddp.register_comm_hook(state, hooks.cluster_hook)
    else:
        state = hooks.LayerSelectionState(process_group=None,
                                          selection=LayerSelection.norm(fraction=args.fraction),
                                          model=model)
        ddp.register_comm_hook(state, hooks.layer_selection_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    shard = torch.arange(rank, len(x_train), size)
    for epoch in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        for start in range(0, len(order), args.batch_size):
            idx = order[start:start + args.batch_size]
            opt.zero_grad()
            F.cross_entropy(ddp(x_train[idx]), y_train[idx]).backward()
            opt.step()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {accuracy:.3f} ({state})", flush=True)

    # The hook's state is a checkpoint item like any other (the process group is not saved).
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "hook": state.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)["hook"]
    if args.hook == "nm":
        restored, what = hooks.NMState.from_state_dict(saved), "buckets"
    elif args.hook == "cluster":
        restored, what = hooks.ClusterState.from_state_dict(saved), "buckets"
    else:   # the layers' residuals are named by parameter: the state is given the model again
        restored, what = hooks.LayerSelectionState.from_state_dict(saved, model=model), "parameters"
    if rank == 0:
        print(f"checkpoint: {len(buffer.getvalue())} bytes, hook state for "
              f"{len(restored.keys())} {what} restored", flush=True)
    finish_distributed(store)


if __name__ == "__main__":
    main()
