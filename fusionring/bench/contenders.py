"""The contenders: what ``fusionring bench`` compares (fusionring, DDP over gloo, MPI's own
allreduce), the model and data they train, and the registry a new contender joins."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from .util import ring_bytes


# ================================================================================ model and data

def build_model(hidden: int, depth: int, bias: bool = True):
    """The communication-heavy MLP on digits: 64 -> hidden x depth -> 10, ReLU (``bias=False``:
    its Linear layers without biases).

    Wide layers give tens of MB of gradients for little compute, so the link decides the step time.
    No normalisation layers: at these widths LayerNorm with SGD+momentum failed to train at all.
    """
    import torch.nn as nn

    layers, width = [], 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden, bias=bias), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, 10, bias=bias))
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

    def __init__(self, ctx: BenchContext, compression, selection=None) -> None:
        import fusionring.torch as hvd

        self._hvd = hvd
        self.model = ctx.build_model()
        # `selection(model)`: a layer selection for DistributedOptimizer(layer_selection=), or None.
        self.optimizer = hvd.DistributedOptimizer(ctx.make_optimizer(self.model.parameters()),
                                                  named_parameters=self.model.named_parameters(),
                                                  compression=compression,
                                                  layer_selection=None if selection is None
                                                  else selection(self.model))
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


def _cluster_missing() -> Optional[str]:
    reason = _fusionring_missing()
    if reason:
        return reason
    import fusionring.torch as hvd

    return None if hasattr(hvd.Compression, "cluster") else "this build has no Compression.cluster"


@register_contender("fusionring-cluster",
                    "fusionring DistributedOptimizer, Compression.cluster(k=16) (4-bit ids, error feedback)",
                    missing=_cluster_missing)
def _fusionring_cluster(ctx: BenchContext) -> Contender:
    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.cluster(k=16))


@register_contender("fusionring-hyper25",
                    "fusionring DistributedOptimizer, LayerSelection.hyper (a quarter of the layers)",
                    missing=_fusionring_missing, default=False)
def _fusionring_hyper25(ctx: BenchContext) -> Contender:
    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.none,
                               lambda model: hvd.LayerSelection.hyper(model, fraction=0.25))


@register_contender("fusionring-hyper25-nm24",
                    "fusionring DistributedOptimizer, LayerSelection.hyper (a quarter of the layers) "
                    "+ Compression.nm(2:4, fp16 values) on the chosen layers",
                    missing=_nm_missing, default=False)
def _fusionring_hyper25_nm24(ctx: BenchContext) -> Contender:
    import torch

    import fusionring.torch as hvd

    return FusionringContender(ctx, hvd.Compression.nm(n=2, m=4, values=torch.float16),
                               lambda model: hvd.LayerSelection.hyper(model, fraction=0.25))


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

    from ..ddp import hooks as fusionring_hooks
    from ..ddp import layer_selection

    for module in (default_hooks, powerSGD_hook, fusionring_hooks, layer_selection):
        if not isinstance(module.dist, _MeteredDistributed):
            module.dist = _MeteredDistributed(dist)


def _unmeter_hook_modules() -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from ..ddp import hooks as fusionring_hooks
    from ..ddp import layer_selection

    for module in (default_hooks, powerSGD_hook, fusionring_hooks, layer_selection):
        module.dist = dist


class DdpContender(Contender):
    """``DistributedDataParallel`` over gloo with a stock communication hook.

    bytes_sent: every tensor the hook passes to ``all_reduce`` (bucket buffers, fp16 copies, PowerSGD's
    uncompressed tensors, P and Q), times the ring volume 2(N-1)/N.

    `state`: the hook's state, or a function of the model that builds it (a state that must know
    the model's layers).
    """

    def __init__(self, ctx: BenchContext, hook, state=None, one_bucket_at_a_time: bool = False) -> None:
        from torch.nn.parallel import DistributedDataParallel

        _meter_hook_modules()
        self._size = ctx.size
        self._meter = _AllreduceMeter()
        self.ddp = DistributedDataParallel(ctx.build_model())
        self.model = self.ddp.module
        if callable(state):
            state = state(self.model)
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

    from ..ddp import hooks

    # Its collective starts in the hook itself, never from a callback: no bucket-at-a-time needed.
    return DdpContender(ctx, hooks.nm_hook, hooks.NMState(n=2, m=4, values=torch.float16))


@register_contender("ddp-layers", "torch DDP, gloo, fusionring.ddp.hooks.layer_selection_hook "
                    "(norm, half the layers, max_wait 3)", missing=_gloo_missing)
def _ddp_layers(ctx: BenchContext) -> Contender:
    from ..ddp import hooks
    from ..selection import LayerSelection

    # Half of the MLP's layers per step (the largest gradient norm per element), none waiting
    # more than 3 steps; one allreduce of the chosen layers after the last bucket.
    return DdpContender(ctx, hooks.layer_selection_hook, lambda model: hooks.LayerSelectionState(
        selection=LayerSelection.norm(fraction=0.5, max_wait=3), model=model))


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
