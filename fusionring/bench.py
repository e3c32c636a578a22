"""``fusionring bench``: fusionring against the peers a user would pick instead, in one run.

One command trains the same model on the same data, ranks and link with every *contender* in turn —
fusionring (dense, fp16, and any compressor registered below), PyTorch DDP over gloo (dense, with
``fp16_compress_hook``, with ``powerSGD_hook``) and MPI's own allreduce — interleaved in one job, and
optionally times raw 64 MiB allreduces of the fusionring core, MPI and gloo. It prints the tables and,
with ``--name``, writes ``docs/benchmarks/<name>.md`` with plots and the command that made it::

    fusionring bench -np 4                                       # localhost, print the tables
    python scripts/bench.py -np 4 --cluster --rates 1gbit,10gbit --name cluster-1gbit
    python scripts/bench.py --list                               # the contenders

A contender is a name in :data:`CONTENDERS` whose setup function returns an object with
``step(batch)`` and ``bytes_sent()`` (see :class:`Contender`); :func:`register_contender` adds one.
See ``docs/bench.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DOC_DIR = REPO_ROOT / "docs" / "benchmarks"
MIB = 1 << 20


def ring_bytes(payload_bytes: float, size: int) -> float:
    """Bytes each rank sends in a ring allreduce of ``payload_bytes``: 2(N-1)/N of it."""
    return payload_bytes * 2 * (size - 1) / size if size > 1 else 0.0


# ================================================================================ model and data

def build_model(hidden: int, depth: int):
    """The communication-heavy MLP on digits: 64 -> hidden x depth -> 10, ReLU.

    Wide layers give tens of MB of gradients for little compute, so the link decides the step time.
    No normalisation layers: at these widths LayerNorm with SGD+momentum failed to train at all.
    """
    import torch.nn as nn

    layers, width = [], 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)



@dataclasses.dataclass
class BenchContext:
    """What a contender's setup needs: ranks, the training recipe and the data of this rank."""

    rank: int
    size: int
    comm: Any                      # mpi4py COMM_WORLD
    hidden: int
    depth: int
    lr: float
    momentum: float
    batch_size: int                # per rank
    seed: int
    train: Tuple[Any, Any]
    test: Tuple[Any, Any]

    def build_model(self):
        """A fresh model, identical on every rank and for every contender (same seed)."""
        import torch

        torch.manual_seed(self.seed)
        return build_model(self.hidden, self.depth)

    def make_optimizer(self, params):
        """The wrapped optimizer every contender uses: SGD with momentum, the same learning rate."""
        import torch

        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def batch(self, step: int):
        """This rank's shard of global batch number ``step`` (the same sequence for every contender)."""
        import torch

        x, y = self.train
        global_batch = self.batch_size * self.size
        per_epoch = len(x) // global_batch
        epoch, index = divmod(step, per_epoch)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed + epoch))
        chosen = order[index * global_batch:(index + 1) * global_batch][self.rank::self.size]
        return x[chosen], y[chosen]

    def accuracy(self, model) -> float:
        """Test accuracy of ``model`` on the held-out fifth of digits."""
        import torch

        x, y = self.test
        was_training = model.training
        model.eval()
        with torch.no_grad():
            value = (model(x).argmax(1) == y).float().mean().item()
        model.train(was_training)
        return value


def _loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.cross_entropy(model(x), y)


# ================================================================================ contenders

class Contender:
    """One way of training data-parallel: ``step(batch)`` runs one synchronous step on this rank.

    ``bytes_sent()`` is the running total of bytes this rank has sent for gradients (how each
    contender counts is documented on it). ``begin_turn``/``end_turn`` bracket each timed turn
    (untimed), ``close`` runs once at the end. ``model`` is what gets evaluated.
    """

    model: Any = None

    def step(self, batch) -> float:
        raise NotImplementedError

    def bytes_sent(self) -> int:
        raise NotImplementedError

    def begin_turn(self) -> None:
        pass

    def end_turn(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class ContenderSpec:
    """A registered contender: its name, a one-line description and how to set it up."""

    name: str
    description: str
    setup: Callable[[BenchContext], Contender]
    missing: Callable[[], Optional[str]]   # why it cannot run here, or None
    default: bool = True                   # part of the run when --contenders is not given


CONTENDERS: Dict[str, ContenderSpec] = {}


def register_contender(name: str, description: str, *, missing: Optional[Callable[[], Optional[str]]] = None,
                       default: bool = True):
    """Decorator: register ``setup(ctx) -> Contender`` under ``name`` (order of registration = order run).

    ``missing`` returns a reason when the contender cannot run in this build (it is then listed as
    unavailable and skipped), or None.
    """
    def register(setup: Callable[[BenchContext], Contender]) -> Callable[[BenchContext], Contender]:
        if name in CONTENDERS:
            raise ValueError(f"contender {name!r} is registered twice")
        CONTENDERS[name] = ContenderSpec(name, description, setup, missing or (lambda: None), default)
        return setup
    return register


def available_contenders() -> List[str]:
    """Names of the registered contenders that can run in this build, in registration order."""
    return [name for name, spec in CONTENDERS.items() if spec.missing() is None]


def default_contenders() -> List[str]:
    return [name for name in available_contenders() if CONTENDERS[name].default]


# ------------------------------------------------------------------------------ fusionring

class FusionringContender(Contender):
    """``hvd.DistributedOptimizer`` with a compression; bytes from ``hvd.communication_stats()``.

    The runtime is started for each turn and shut down after it: its background loop negotiates every
    cycle even when idle (an MPI allreduce each 1 ms, each 10 ms after a quiet spell), which on a machine
    with fewer cores than ranks would otherwise take CPU from the peers during their turns. Restarting
    costs one uncached negotiation in the turn's first step, which stays in the timing.
    """

    def __init__(self, ctx: BenchContext, compression) -> None:
        import fusionring.torch as hvd

        self._hvd = hvd
        self.model = ctx.build_model()
        self.optimizer = hvd.DistributedOptimizer(ctx.make_optimizer(self.model.parameters()),
                                                  named_parameters=self.model.named_parameters(),
                                                  compression=compression)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self._sent_before_turns = 0
        self._turn_start: Optional[int] = None  # runtime bytes at the start of the turn under way

    def _runtime_bytes(self) -> int:
        return int(self._hvd.communication_stats()["bytes_sent"])

    def begin_turn(self) -> None:
        self._hvd.init()
        self._turn_start = self._runtime_bytes()

    def end_turn(self) -> None:
        self._sent_before_turns += self._runtime_bytes() - self._turn_start
        self._turn_start = None
        self._hvd.shutdown()

    def step(self, batch) -> float:
        self.optimizer.zero_grad()
        loss = _loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def bytes_sent(self) -> int:
        running = 0 if self._turn_start is None else self._runtime_bytes() - self._turn_start
        return self._sent_before_turns + running


def _fusionring_missing() -> Optional[str]:
    try:
        import fusionring.torch  # noqa: F401
    except ImportError as exc:
        return f"fusionring.torch does not import: {exc}"
    return None


def _nm_missing() -> Optional[str]:
    reason = _fusionring_missing()
    if reason:
        return reason
    import fusionring.torch as hvd

    return None if hasattr(hvd.Compression, "nm") else "this build has no Compression.nm"


@register_contender("fusionring", "fusionring DistributedOptimizer, threshold fusion, no compression (fp32)",
                    missing=_fusionring_missing)
def _fusionring_dense(ctx: BenchContext) -> Contender:
    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.none)


@register_contender("fusionring-fp16", "fusionring DistributedOptimizer, Compression.fp16",
                    missing=_fusionring_missing)
def _fusionring_fp16(ctx: BenchContext) -> Contender:
    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.fp16)


@register_contender("fusionring-nm24", "fusionring DistributedOptimizer, Compression.nm(2:4, fp16 values)",
                    missing=_nm_missing)
def _fusionring_nm24(ctx: BenchContext) -> Contender:
    import torch

    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.nm(n=2, m=4, values=torch.float16))


# ------------------------------------------------------------------------------ DDP over gloo

class _AllreduceMeter:
    """Counts the payload bytes a DDP communication hook hands to ``all_reduce``."""

    current: Optional["_AllreduceMeter"] = None

    def __init__(self) -> None:
        self.payload_bytes = 0


class _MeteredDistributed:
    """Stands in for ``torch.distributed`` inside the hook modules and meters ``all_reduce``.

    The hooks start some all_reduces from future callbacks (PowerSGD's P and Q), after the hook
    itself returned; the meter of the hook that ran last gets them, which is right because only one
    DDP model trains at a time here.
    """

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def all_reduce(self, tensor, *args, **kwargs):
        meter = _AllreduceMeter.current
        if meter is not None:
            meter.payload_bytes += tensor.numel() * tensor.element_size()
        return self._real.all_reduce(tensor, *args, **kwargs)


def _meter_hook_modules() -> None:
    """Route the hook modules' ``dist.all_reduce`` through the meter (idempotent)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from .ddp import hooks as fusionring_hooks

    for module in (default_hooks, powerSGD_hook, fusionring_hooks):
        if not isinstance(module.dist, _MeteredDistributed):
            module.dist = _MeteredDistributed(dist)


def _unmeter_hook_modules() -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from .ddp import hooks as fusionring_hooks

    for module in (default_hooks, powerSGD_hook, fusionring_hooks):
        module.dist = dist


class DdpContender(Contender):
    """``DistributedDataParallel`` over gloo with a stock communication hook.

    bytes_sent: every tensor the hook passes to ``all_reduce`` (bucket buffers, fp16 copies, PowerSGD's
    uncompressed tensors, P and Q), times the ring volume 2(N-1)/N.
    """

    def __init__(self, ctx: BenchContext, hook, state=None, one_bucket_at_a_time: bool = False) -> None:
        from torch.nn.parallel import DistributedDataParallel

        _meter_hook_modules()
        self._size = ctx.size
        self._meter = _AllreduceMeter()
        self.ddp = DistributedDataParallel(ctx.build_model())
        self.model = self.ddp.module
        meter = self._meter
        in_flight = []

        def metered_hook(state, bucket):  # DDP requires the parameter names (state, bucket)
            _AllreduceMeter.current = meter
            if in_flight:
                in_flight.pop().wait()
            future = hook(state, bucket)
            if one_bucket_at_a_time and not bucket.is_last():
                in_flight.append(future)
            return future

        self.ddp.register_comm_hook(state, metered_hook)
        self.optimizer = ctx.make_optimizer(self.ddp.parameters())

    def step(self, batch) -> float:
        self.optimizer.zero_grad()
        loss = _loss(self.ddp, batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def bytes_sent(self) -> int:
        return int(round(ring_bytes(self._meter.payload_bytes, self._size)))


def _gloo_missing() -> Optional[str]:
    import torch.distributed as dist

    return None if dist.is_available() and dist.is_gloo_available() else "torch has no gloo backend"


@register_contender("ddp", "torch DDP, gloo, default allreduce (fp32)", missing=_gloo_missing)
def _ddp_dense(ctx: BenchContext) -> Contender:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return DdpContender(ctx, default_hooks.allreduce_hook)


@register_contender("ddp-fp16", "torch DDP, gloo, fp16_compress_hook", missing=_gloo_missing)
def _ddp_fp16(ctx: BenchContext) -> Contender:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return DdpContender(ctx, default_hooks.fp16_compress_hook)


@register_contender("ddp-powersgd", "torch DDP, gloo, powerSGD_hook (rank 2, error feedback, from step 2)",
                    missing=_gloo_missing)
def _ddp_powersgd(ctx: BenchContext) -> Contender:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                        start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    # The hook starts its P and Q allreduces from future callbacks. Over gloo, with more than one
    # bucket, a callback of bucket k and the hook of bucket k+1 race, the ranks start collectives in
    # different orders and gloo aborts ("Received data size doesn't match expected size"). So each
    # bucket's chain finishes before the next bucket starts; the backward pass still overlaps it.
    return DdpContender(ctx, powerSGD_hook.powerSGD_hook, state, one_bucket_at_a_time=True)


@register_contender("ddp-nm24", "torch DDP, gloo, fusionring.ddp.hooks.nm_hook (2:4, fp16 values, shared mask)",
                    missing=_gloo_missing)
def _ddp_nm24(ctx: BenchContext) -> Contender:
    import torch

    from .ddp import hooks

    # Its collective starts in the hook itself, never from a callback: no bucket-at-a-time needed.
    return DdpContender(ctx, hooks.nm_hook, hooks.NMState(n=2, m=4, values=torch.float16))


# ------------------------------------------------------------------------------ MPI's allreduce

class MpiAllreduceContender(Contender):
    """mpi4py in-place ``Allreduce`` of all gradients flattened into one fp32 buffer, every step.

    bytes_sent: the buffer times 2(N-1)/N (MPICH's large-message allreduce, reduce-scatter +
    allgather, sends that much, as a ring does).
    """

    def __init__(self, ctx: BenchContext) -> None:
        import torch
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = ctx.comm.Dup()
        self._size = ctx.size
        self.model = ctx.build_model()
        self.optimizer = ctx.make_optimizer(self.model.parameters())
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._flat = torch.zeros(sum(p.numel() for p in self._params), dtype=torch.float32)
        self._steps = 0

    def step(self, batch) -> float:
        import torch

        self.optimizer.zero_grad()
        loss = _loss(self.model, batch)
        loss.backward()
        offset = 0
        views = []
        for p in self._params:
            view = self._flat[offset:offset + p.numel()]
            view.copy_(p.grad.reshape(-1))
            views.append((p, view))
            offset += p.numel()
        self._comm.Allreduce(self._MPI.IN_PLACE, self._flat.numpy(), op=self._MPI.SUM)
        self._flat.div_(self._size)
        with torch.no_grad():
            for p, view in views:
                p.grad.copy_(view.view_as(p.grad))
        self.optimizer.step()
        self._steps += 1
        return loss.item()

    def bytes_sent(self) -> int:
        return int(round(ring_bytes(self._flat.numel() * 4, self._size) * self._steps))

    def close(self) -> None:
        self._comm.Free()


@register_contender("mpi", "mpi4py Allreduce of the flattened fp32 gradients")
def _mpi_allreduce(ctx: BenchContext) -> Contender:
    return MpiAllreduceContender(ctx)


# ================================================================================ on every rank

def interface_address(interface: str) -> str:
    """The IPv4 address of ``interface`` in this network namespace (``127.0.0.1`` for ``lo``)."""
    if interface == "lo":
        return "127.0.0.1"
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def interface_tx_bytes(interface: str) -> Optional[int]:
    """Bytes ``interface`` has transmitted (this namespace's /proc/net/dev), or None if absent."""
    try:
        with open("/proc/net/dev") as table:
            for line in table:
                name, sep, counters = line.partition(":")
                if sep and name.strip() == interface:
                    return int(counters.split()[8])
    except OSError:
        pass
    return None


def _init_gloo(comm, interface: str) -> str:
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
        return interface_tx_bytes(self._interface) if self._interface else None

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
    from fusionring.runtime import DTYPE_CODES

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
    master = _init_gloo(comm, interface)
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
        from .datasets import load_digits_split

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


# ================================================================================ the driver

@dataclasses.dataclass
class LinkRun:
    """One launch: a link (a rate in the lab, or localhost) and what its ranks reported."""

    label: str
    rate_bits_per_s: Optional[int]
    launch: str
    result: Dict[str, Any]
    uptime_before: str
    uptime_after: str
    command: str = ""  # the harness command that made this run

    @property
    def heading(self) -> str:
        parts = [part for part, key in (("raw allreduce", "collectives"), ("training", "training"))
                 if key in self.result]
        return self.label if len(parts) == 2 else f"{self.label}: {' and '.join(parts)}"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "load average: %.2f, %.2f, %.2f" % os.getloadavg()


def _worker_argv(args: argparse.Namespace, out: Path, contenders: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "fusionring.bench", "--worker", "--out", str(out),
            "--mode", args.mode, "--contenders", ",".join(contenders),
            "--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
            "--hidden", str(args.hidden), "--depth", str(args.depth), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--momentum", str(args.momentum), "--seed", str(args.seed),
            "--collective-mib", str(args.collective_mib),
            "--collective-repeats", str(args.collective_repeats)] + [
            word for module in args.imports for word in ("--import", module)]


def _wait_for_free_lab(wait_s: float) -> None:
    from fusionring import cluster

    deadline = time.monotonic() + wait_s
    while True:
        busy = cluster.existing_namespaces()
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"fusionring bench: the lab is up ({', '.join(busy)}), so another run is using "
                             f"it; wait for it (--wait-for-lab-s) or remove it with `scripts/cluster.sh down`")
        time.sleep(5)


def _launch(args: argparse.Namespace, rate: Optional[str], contenders: Sequence[str], command: str) -> LinkRun:
    from fusionring import cluster

    with tempfile.TemporaryDirectory(prefix="fusionring-bench-") as scratch:
        out = Path(scratch) / "result.json"
        argv = [sys.executable, "-m", "fusionring.launcher", "-np", str(args.np)]
        if rate is not None:
            argv += ["--cluster", str(args.np), "--rate", rate]
        if args.mpiexec:
            argv += ["--mpiexec", args.mpiexec]
        argv += _worker_argv(args, out, contenders)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                  else []))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no hostnames
        if rate is not None:
            _wait_for_free_lab(args.wait_for_lab_s)
        label = rate or "localhost"
        print(f"fusionring bench: {label}: {args.np} ranks ...", flush=True)
        uptime_before = _uptime()
        child = subprocess.Popen(argv, env=env, cwd=str(REPO_ROOT))
        try:
            returncode = child.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            # fusionrun passes SIGTERM on to mpiexec and removes the lab; kill only if it does not
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise SystemExit(f"fusionring bench: the {label} run took longer than {args.timeout_s} s "
                             f"(--timeout-s); stopped it")
        if returncode != 0 or not out.exists():
            raise SystemExit(f"fusionring bench: the {label} run failed (exit {returncode})")
        result = json.loads(out.read_text())
    shown = ["fusionrun", "-np", str(args.np)] + (["--cluster", str(args.np), "--rate", rate] if rate else [])
    shown += ["python", "-m", "fusionring.bench", "--worker", "--out", "RESULT.json"]
    shown += _worker_argv(args, out, contenders)[6:]
    return LinkRun(label, cluster.parse_rate(rate) if rate else None, shlex.join(shown), result,
                   uptime_before, _uptime(), command)


# ----------------------------------------------------------------------------- summaries

def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def time_to_accuracy(history: Sequence[Dict[str, float]], target: float) -> Optional[Dict[str, float]]:
    """The first evaluation at or above ``target``: its step count and cumulative training seconds."""
    for point in history:
        if point["accuracy"] is not None and point["accuracy"] >= target:
            return {"steps": point["step"], "seconds": point["seconds"]}
    return None


def summarize_training(run: LinkRun, target: float) -> List[Dict[str, Any]]:
    """Per contender: medians over turns, samples/s, bytes, final accuracy, time to ``target``."""
    training = run.result["training"]
    size = run.result["ranks"]
    global_batch = run.result["model"]["batch_size"] * size
    rows = []
    for name, data in training["contenders"].items():
        turns = data["turns"]
        step_s = _median([t["step_seconds"] for t in turns])
        sent = _median([t["bytes_per_step"] for t in turns])
        wire = _median([t["wire_bytes_per_step"] for t in turns])
        on_link = wire if wire is not None else sent  # what the link carried, where it was measured
        rows.append({
            "name": name, "description": data["description"], "step_seconds": step_s,
            "step_seconds_min": min((t["step_seconds"] for t in turns), default=None),
            "step_seconds_max": max((t["step_seconds"] for t in turns), default=None),
            "samples_per_s": global_batch / step_s if step_s else None,
            "bytes_per_step": sent, "wire_bytes_per_step": wire,
            "link_seconds": on_link * 8 / run.rate_bits_per_s if run.rate_bits_per_s and on_link is not None
            else None,
            "final_accuracy": data["history"][-1]["accuracy"] if data["history"] else None,
            "steps": data["history"][-1]["step"] if data["history"] else 0,
            "tta": time_to_accuracy(data["history"], target),
        })
    return rows


def summarize_collectives(run: LinkRun) -> List[Dict[str, Any]]:
    """Per method: median and best time, algorithm and bus bandwidth, share of the link rate."""
    coll = run.result["collectives"]
    size, nbytes = run.result["ranks"], coll["bytes"]
    rows = []
    for name, data in coll["methods"].items():
        median = _median(data["seconds"])
        busbw = ring_bytes(nbytes, size) * 8 / median if median else None
        rows.append({
            "name": name, "description": data["description"], "seconds": median,
            "seconds_min": min(data["seconds"]) if data["seconds"] else None,
            "busbw_bits_per_s": busbw,
            "link_fraction": busbw / run.rate_bits_per_s if busbw and run.rate_bits_per_s else None,
            "wire_bytes": _median(data["wire_bytes"]),
        })
    return rows


# ----------------------------------------------------------------------------- rendering

def _fmt(value: Optional[float], spec: str, scale: float = 1.0, missing: str = "–") -> str:
    return missing if value is None else format(value / scale, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


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
    try:
        text = page.read_text()
    except OSError:
        return None
    start, end = text.find(FINDINGS_START), text.find(FINDINGS_END)
    return text[start:end + len(FINDINGS_END)] if 0 <= start < end else None


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


def _runs_to_json(runs: Sequence[LinkRun]) -> List[Dict[str, Any]]:
    return [dataclasses.asdict(run) for run in runs]


def load_runs(paths: Sequence[str]) -> List[LinkRun]:
    """The runs saved with ``--json`` in each of ``paths``, in order."""
    runs = []
    for path in paths:
        payload = json.loads(Path(path).read_text())
        for item in payload["runs"]:
            item.setdefault("command", payload.get("command", ""))
            runs.append(LinkRun(**item))
    return runs


def run_driver(args: argparse.Namespace, command: str) -> int:
    """Launch one job per link, print the tables, write the page (with --name) and the raw JSON."""
    if args.from_json:
        runs = load_runs(args.from_json)
    else:
        contenders = args.contenders.split(",") if args.contenders else default_contenders()
        for contender in contenders:
            spec = CONTENDERS.get(contender)
            if spec is None:
                raise SystemExit(f"fusionring bench: unknown contender {contender!r}; known: "
                                 f"{', '.join(CONTENDERS)}")
            reason = spec.missing()
            if reason:
                raise SystemExit(f"fusionring bench: contender {contender!r} cannot run here: {reason}")
        rates = [r.strip() for r in args.rates.split(",") if r.strip()] if args.cluster else [None]
        runs = []
        for rate in rates:
            runs.append(_launch(args, rate, contenders, command))
            if args.json:  # keep what finished even if a later link fails
                Path(args.json).write_text(json.dumps({"command": command, "runs": _runs_to_json(runs)},
                                                      indent=1))
    print_summary(runs, args.target_accuracy)
    if args.name:
        doc_dir = Path(args.doc_dir)
        doc_dir.mkdir(parents=True, exist_ok=True)
        images = plot_runs(runs, args.target_accuracy, doc_dir, args.name)
        page = doc_dir / f"{args.name}.md"
        rendered_by = command if args.from_json else None
        page.write_text(render_markdown(runs, args.target_accuracy, images, args.name, rendered_by,
                                        kept_findings(page)) + "\n")
        print(f"\nwrote {page}" + "".join(f", {doc_dir / i}" for i in images))
    return 0


# ================================================================================ command line

def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fusionring bench`` (and ``scripts/bench.py``)."""
    parser.add_argument("-np", "--np", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--cluster", action="store_true",
                        help="run each rank in its own namespace of the emulated cluster (root), once per rate")
    parser.add_argument("--rates", default="1gbit",
                        help="with --cluster: comma-separated link rates, one launch each (default 1gbit)")
    parser.add_argument("--mode", choices=("both", "train", "collectives"), default="both",
                        help="training comparison, raw allreduce timing, or both (default)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated contenders (default: every available one; see --list)")
    parser.add_argument("--list", action="store_true", help="list the contenders and exit")
    parser.add_argument("--steps", type=int, default=4, help="steps per contender per turn (default 4)")
    parser.add_argument("--repeats", type=int, default=10, help="rounds of turns (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.9,
                        help="test accuracy for time-to-accuracy (default 0.9)")
    parser.add_argument("--collective-mib", type=int, default=64, help="raw allreduce size (default 64 MiB)")
    parser.add_argument("--collective-repeats", type=int, default=5)
    parser.add_argument("--name", default=None,
                        help="write <doc-dir>/<name>.md and its plots (default: print only)")
    parser.add_argument("--doc-dir", default=str(DEFAULT_DOC_DIR))
    parser.add_argument("--json", default=None, help="also save the raw results here")
    parser.add_argument("--from-json", action="append", default=[], metavar="PATH",
                        help="render from results saved with --json (repeat to merge runs); run nothing")
    parser.add_argument("--timeout-s", type=float, default=480, help="limit per launch (default 480)")
    parser.add_argument("--wait-for-lab-s", type=float, default=0,
                        help="with --cluster: wait this long for a lab already up to go away (default: fail)")
    parser.add_argument("--mpiexec", default=None, help="mpiexec to use (passed to fusionrun)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first on the driver and every rank (it may register contenders)")
    # the per-rank side, started by the driver through fusionrun
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interface", default=None, help=argparse.SUPPRESS)


def _list_contenders() -> int:
    for name, spec in CONTENDERS.items():
        reason = spec.missing()
        state = "" if reason is None else f"   [unavailable: {reason}]"
        print(f"{name:18s} {spec.description}{state}")
    return 0


def run_command(args: argparse.Namespace, command: Optional[str] = None) -> int:
    """Run ``fusionring bench`` with parsed ``args``; ``command`` is the line recorded in the page."""
    for module in args.imports:
        importlib.import_module(module)
    if args.list:
        return _list_contenders()
    if args.worker:
        if args.out is None or args.contenders is None:
            raise SystemExit("--worker needs --out and --contenders")
        return run_worker(args)
    if command is None:
        command = shlex.join(["fusionring", "bench"] + sys.argv[2:])
    return run_driver(args, command)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m fusionring.bench") -> int:
    """Entry point for ``python -m fusionring.bench`` and ``scripts/bench.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    configure_parser(parser)
    args = parser.parse_args(argv)
    return run_command(args, shlex.join(shlex.split(prog) + argv))


if __name__ == "__main__":
    sys.exit(main())
