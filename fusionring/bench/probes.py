"""What runs on every rank of a benchmark job: raw collectives timed on each transport, and
the contenders' training, interleaved, with per-rank counters of bytes and time."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fusionring import network
from .contenders import CONTENDERS, BenchContext, Contender
from .util import MIB


# ================================================================================ on every rank

def interface_address(interface: str) -> str:
    """The IPv4 address of ``interface`` in this network namespace (``127.0.0.1`` for ``lo``)."""
    if interface == "lo":
        return "127.0.0.1"
    address = network.interface_address(interface)
    if address is None:
        raise ValueError(f"network interface {interface!r} has no IPv4 address here")
    return address


def init_gloo(comm, interface: str) -> str:
    """Start torch.distributed (gloo) on the ranks of ``comm``; rank 0's address and a port it picked."""
    import torch.distributed as dist

    address, port = None, None
    if comm.Get_rank() == 0:
        address = interface_address(interface)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind((address, 0))
            port = listener.getsockname()[1]
    address, port = comm.bcast((address, port), root=0)
    os.environ["GLOO_SOCKET_IFNAME"] = interface  # gloo's own connections on the same interface
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=datetime.timedelta(seconds=120))
    return address


class _RankCounters:
    """Mean over ranks of a per-rank counter's change across a block of work (collective)."""

    def __init__(self, comm, interface: str) -> None:
        self._comm = comm
        # on loopback every rank shares the counter: no per-rank wire bytes there
        self._interface = None if interface == "lo" else interface

    def wire(self) -> Optional[int]:
        return network.interface_tx_bytes(self._interface) if self._interface else None

    def mean_delta(self, before: Optional[float], after: Optional[float]) -> Optional[float]:
        delta = None if before is None or after is None else after - before
        deltas = self._comm.allgather(delta)
        return None if any(d is None for d in deltas) else sum(deltas) / len(deltas)


def _timed_max(comm, body: Callable[[], None]) -> float:
    """Seconds ``body`` takes from a common start (a barrier), the slowest rank's (collective)."""
    comm.Barrier()
    start = time.perf_counter()
    body()
    return comm.allreduce(time.perf_counter() - start, op=_mpi().MAX)


def _mpi():
    from mpi4py import MPI

    return MPI


def run_collectives(comm, interface: str, nbytes: int, repeats: int) -> Dict[str, Any]:
    """Time in-place sum-allreduces of ``nbytes`` of fp32: fusionring core and runtime, MPI, gloo.

    Each repeat runs every method once, in rotating order, after one warm-up each; a time is the
    slowest rank's. Returns per-method times (s) and wire bytes per rank per allreduce.
    """
    import torch
    import torch.distributed as dist

    import fusionring.torch as hvd
    from fusionring import _C
    from fusionring.config import settings
    from fusionring.dtypes import DTYPE_CODES

    MPI = _mpi()
    count = nbytes // 4
    buffer = torch.ones(count, dtype=torch.float32)
    core_comm = comm.Dup()
    core = _C.Communicator(MPI._handleof(core_comm))
    mpi_comm = comm.Dup()
    config = settings()

    def core_allreduce():
        core.allreduce(buffer.data_ptr(), count, DTYPE_CODES[torch.float32], 0, 1.0, 1.0,
                       config.ring_segment_bytes, config.small_message_bytes)

    def runtime_allreduce():
        hvd.allreduce_(buffer, op=hvd.Sum, name="bench.collective")

    methods: Dict[str, Tuple[str, Callable[[], None]]] = {
        "fusionring-core": ("fusionring `_C.Communicator.allreduce` (the C++ ring, no runtime)", core_allreduce),
        "fusionring": ("fusionring `hvd.allreduce_` (negotiation + ring, through the runtime)",
                       runtime_allreduce),
        "mpi": ("mpi4py in-place `Allreduce` (MPICH)",
                lambda: mpi_comm.Allreduce(MPI.IN_PLACE, buffer.numpy(), op=MPI.SUM)),
        "gloo": ("`torch.distributed.all_reduce`, gloo", lambda: dist.all_reduce(buffer)),
    }
    counters = _RankCounters(comm, interface)
    results = {name: {"description": description, "seconds": [], "wire_bytes": []}
               for name, (description, _) in methods.items()}
    names = list(methods)

    def one(name: str, record: bool) -> None:
        if name == "fusionring":
            hvd.init()
        buffer.fill_(1.0)
        before = counters.wire()
        seconds = _timed_max(comm, methods[name][1])
        wire = counters.mean_delta(before, counters.wire())
        if name == "fusionring":
            hvd.shutdown()
        if record:
            results[name]["seconds"].append(seconds)
            results[name]["wire_bytes"].append(wire)

    for name in names:
        one(name, record=False)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            one(name, record=True)
    core_comm.Free()
    mpi_comm.Free()
    return {"bytes": count * 4, "repeats": repeats, "methods": results}


@dataclasses.dataclass
class _Progress:
    """One contender's training so far."""

    contender: Contender
    steps: int = 0
    seconds: float = 0.0
    turns: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    history: List[Dict[str, float]] = dataclasses.field(default_factory=list)


def run_training(ctx: BenchContext, names: Sequence[str], interface: str, steps_per_turn: int,
                 repeats: int, warmup: int) -> Dict[str, Any]:
    """Train every contender from the same start, ``steps_per_turn`` steps per turn, interleaved.

    Warm-up (``warmup`` steps each) first; then ``repeats`` rounds, each giving every contender one
    turn in rotating order. A turn's step time is (barrier to barrier) / steps, the slowest rank's.
    Rank 0 evaluates test accuracy after warm-up and after every turn (untimed).
    """
    import fusionring.torch as hvd

    comm = ctx.comm
    counters = _RankCounters(comm, interface)
    progress: Dict[str, _Progress] = {}
    skipped: Dict[str, str] = {}
    hvd.init()  # fusionring contenders are built with their runtime up, then it is stopped
    for name in names:
        try:
            progress[name] = _Progress(CONTENDERS[name].setup(ctx))
        except Exception as exc:  # noqa: BLE001 - deterministic on every rank, so all skip it alike
            skipped[name] = f"{type(exc).__name__}: {exc}"
    hvd.shutdown()
    active = [name for name in names if name in progress]

    def turn(name: str, steps: int) -> Dict[str, Any]:
        state = progress[name]
        state.contender.begin_turn()
        sent_before, wire_before = state.contender.bytes_sent(), counters.wire()
        losses = []

        def body():
            for _ in range(steps):
                losses.append(state.contender.step(ctx.batch(state.steps)))
                state.steps += 1

        seconds = _timed_max(comm, body)
        sent = counters.mean_delta(sent_before, state.contender.bytes_sent())
        wire = counters.mean_delta(wire_before, counters.wire())
        state.contender.end_turn()
        state.seconds += seconds
        accuracy = ctx.accuracy(state.contender.model) if ctx.rank == 0 else None
        state.history.append({"step": state.steps, "seconds": state.seconds, "accuracy": accuracy,
                              "loss": losses[-1]})
        return {"step_seconds": seconds / steps, "bytes_per_step": sent / steps,
                "wire_bytes_per_step": None if wire is None else wire / steps}

    for name in active:
        if warmup:
            turn(name, warmup)
    for repeat in range(repeats):
        shift = repeat % len(active) if active else 0
        for name in active[shift:] + active[:shift]:
            progress[name].turns.append(turn(name, steps_per_turn))
    for state in progress.values():
        state.contender.close()
    return {
        "contenders": {name: {"description": CONTENDERS[name].description, "turns": state.turns,
                              "history": state.history}
                       for name, state in progress.items()},
        "skipped": skipped,
    }


def run_worker(args: argparse.Namespace) -> int:
    """The per-rank body: start gloo and fusionring, run the requested parts, rank 0 writes JSON."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)  # several ranks share few cores: no intra-op thread oversubscription
    interface = args.interface or os.environ.get("FI_TCP_IFACE") or "lo"
    master = init_gloo(comm, interface)
    started = time.time()
    result: Dict[str, Any] = {
        "ranks": size, "interface": interface, "master_address": master,
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
        "torch": torch.__version__, "load_before": os.getloadavg(),
    }
    if args.mode in ("both", "collectives"):
        result["collectives"] = run_collectives(comm, interface, args.collective_mib * MIB,
                                                args.collective_repeats)
    if args.mode in ("both", "train"):
        from ..datasets import load_digits_split

        train, test = load_digits_split(args.seed)
        ctx = BenchContext(rank, size, comm, args.hidden, args.depth, args.lr, args.momentum,
                           args.batch_size, args.seed, train, test)
        model = ctx.build_model()
        parameters = sum(p.numel() for p in model.parameters())
        result["model"] = {"hidden": args.hidden, "depth": args.depth, "parameters": parameters,
                           "gradient_bytes": parameters * 4, "batch_size": args.batch_size,
                           "lr": args.lr, "momentum": args.momentum, "train_samples": len(train[0]),
                           "test_samples": len(test[0])}
        result["training"] = run_training(ctx, args.contenders.split(","), interface, args.steps,
                                          args.repeats, args.warmup)
        result["training"].update(steps_per_turn=args.steps, repeats=args.repeats, warmup=args.warmup)
    result["load_after"] = os.getloadavg()
    result["worker_seconds"] = time.time() - started
    comm.Barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
