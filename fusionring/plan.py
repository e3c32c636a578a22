"""The offline half of balanced fusion: profile a model, partition its gradients, write a plan.

Before training, :func:`make_plan` runs a few forward/backward passes to learn each trainable
parameter's gradient size and the order in which gradients become ready during backward. It picks
a fusion-buffer size from an allreduce cost model and cuts the ready order into contiguous groups of
nearly equal size, each close to that buffer. The result is a :class:`Plan`, saved as versioned
JSON; the online half (:mod:`fusionring.scheduler`) fuses each group into one buffer once all of
its gradients are ready. ``fusionring plan ...`` on the command line runs the same code
(:func:`configure_parser`, :func:`run_command`). See ``docs/plan.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import math
import os
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import units

PLAN_FORMAT = "fusionring-plan"
PLAN_VERSION = 1

KIB = 1024
MIB = 1024 * 1024
MIN_AUTO_BUFFER_BYTES = 64 * KIB
MAX_AUTO_BUFFER_BYTES = 64 * MIB

# Default link model (per message latency, bytes per second), turned into a ring-allreduce cost
# by CostModel.ring_default. With two ranks it gives alpha = 30 us + REQUEST_OVERHEAD_S and 1 GB/s.
DEFAULT_LINK_LATENCY_S = 15e-6
DEFAULT_LINK_BANDWIDTH_BYTES_PER_S = 1e9
# What each fused buffer costs fusionring itself, whatever the links: submitting it, agreeing on
# it in a cycle and completing it, in Python beside the training thread. Measured in training at
# 2 ranks with a core each (scripts/bench_fusion.py, plans of 48, 16 and 7 groups of one model):
# 66-110 us per group more than the ring's own latency there (5-10 us).
REQUEST_OVERHEAD_S = 60e-6

# The variance refinement builds (n+1)^2 matrices and runs k passes over them (2000 tensors in 100
# groups: about 2 s and 150 MB); past these limits a greedy min-max partition is used instead.
_REFINE_WORK_LIMIT = 400_000_000
_REFINE_MAX_TENSORS = 3000


class PlanFormatError(ValueError):
    """The file or dict is not a grouping plan this version of fusionring can read."""


class PlanMismatchError(ValueError):
    """A plan was made for a model whose parameters differ from the one it is applied to."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"grouping plan does not match the model ({len(self.problems)} "
            f"parameter{'s' if len(self.problems) != 1 else ''} differ):\n{lines}"
        )


# --------------------------------------------------------------------------------------------
# Cost model and buffer size


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Allreduce time of one fused buffer: ``alpha_s + beta_s_per_byte * bytes``."""

    alpha_s: float
    beta_s_per_byte: float
    source: str = "default"

    def seconds(self, nbytes: int) -> float:
        """Predicted time to allreduce one buffer of ``nbytes`` bytes."""
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @classmethod
    def ring_default(cls, world_size: Optional[int] = None) -> "CostModel":
        """Ring allreduce over default links: 2(N-1) latencies, 2(N-1)/N of the bytes per link,
        plus fusionring's own cost per buffer (REQUEST_OVERHEAD_S).

        ``world_size`` None is taken as 2 ranks (alpha 90 us, 1 GB/s)."""
        n = max(2, int(world_size or 2))
        alpha = 2 * (n - 1) * DEFAULT_LINK_LATENCY_S + REQUEST_OVERHEAD_S
        beta = 2 * (n - 1) / n / DEFAULT_LINK_BANDWIDTH_BYTES_PER_S
        return cls(alpha, beta, "default")

    @classmethod
    def fit(cls, samples: Sequence[Tuple[int, float]], source: str = "probe") -> "CostModel":
        """A line through (bytes, seconds) samples that one disturbed sample cannot swing;
        alpha >= 0, beta > 0.

        The slope is the median of the slopes between every two sizes (Theil-Sen) and the
        intercept the median of what each sample leaves after it: a timing stretched by a
        preempted rank moves neither, where a least-squares line could tilt by orders of
        magnitude. No positive slope (noise swamping the sizes) falls back to the default
        beta."""
        if len(samples) < 2:
            raise ValueError("fitting a cost model needs at least two (bytes, seconds) samples")
        x = np.array([float(b) for b, _ in samples])
        y = np.array([float(t) for _, t in samples])
        slopes = [(y[j] - y[i]) / (x[j] - x[i])
                  for i in range(len(x)) for j in range(i + 1, len(x)) if x[j] != x[i]]
        if not slopes:
            raise ValueError("fitting a cost model needs samples of at least two sizes")
        beta = float(np.median(slopes))
        if not beta > 0:
            beta = CostModel.ring_default().beta_s_per_byte
        alpha = float(np.median(y - beta * x))
        return cls(max(0.0, alpha), beta, source)


def mpi_allreduce_probe(comm: Any = None, repeats: int = 7) -> Callable[[int], float]:
    """A probe timing ``MPI.Allreduce`` of float32 buffers on ``comm`` (COMM_WORLD by default).

    Collective: every rank must call the returned probe with the same sizes. Each rank keeps its
    fastest repeat (other work on the host only ever adds time), and each size reports the slowest
    rank's, so every rank fits the same cost model."""
    from mpi4py import MPI  # imported here so that planning needs no MPI unless asked

    comm = comm if comm is not None else MPI.COMM_WORLD

    def probe(nbytes: int) -> float:
        count = max(1, int(nbytes) // 4)
        send = np.ones(count, dtype=np.float32)
        recv = np.empty_like(send)
        comm.Allreduce(send, recv, op=MPI.SUM)  # warm-up
        times = []
        for _ in range(repeats):
            comm.Barrier()
            start = MPI.Wtime()
            comm.Allreduce(send, recv, op=MPI.SUM)
            times.append(MPI.Wtime() - start)
        return float(comm.allreduce(float(np.min(times)), op=MPI.MAX))

    return probe


# A small size pins the latency; the larger ones the bandwidth.
PROBE_SIZES_BYTES = (4 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)


def cost_model_from_probe(probe: Union[None, str, Callable[[int], float], CostModel],
                          world_size: Optional[int] = None) -> CostModel:
    """Turn ``make_plan``'s ``probe`` argument into a cost model.

    None: ring defaults for ``world_size``; "mpi": time MPI Allreduce on COMM_WORLD (collective)
    and add fusionring's own cost per buffer (REQUEST_OVERHEAD_S); a callable(bytes) -> seconds:
    sampled at a few sizes and fitted; a CostModel: used as is."""
    if probe is None:
        return CostModel.ring_default(world_size)
    if isinstance(probe, CostModel):
        return probe
    if isinstance(probe, str):
        if probe == "default":
            return CostModel.ring_default(world_size)
        if probe != "mpi":
            raise ValueError(f"unknown probe {probe!r}; expected None, 'default', 'mpi' or a callable")
        timed = mpi_allreduce_probe()
        fitted = CostModel.fit([(size, float(timed(size))) for size in PROBE_SIZES_BYTES],
                               source="mpi")
        # MPI's collective alone: each of fusionring's buffers also pays its own handling.
        return CostModel(fitted.alpha_s + REQUEST_OVERHEAD_S, fitted.beta_s_per_byte, "mpi")
    samples = [(size, float(probe(size))) for size in PROBE_SIZES_BYTES]
    return CostModel.fit(samples, source="probe")


def choose_buffer_bytes(total_bytes: int, cost: CostModel, *, max_overhead: float = 0.05,
                        min_groups: int = 4) -> int:
    """Fusion-buffer size for ``total_bytes`` of gradients under ``cost``.

    B = max(latency floor, min(sqrt(alpha*total/beta), total/min_groups)), rounded up to 64 KiB and
    clamped to [64 KiB, 64 MiB]. The floor alpha/(max_overhead*beta) keeps each group's latency at
    most ``max_overhead`` of its transfer time; sqrt(alpha*total/beta) minimises the per-step cost
    (total/B)*alpha + beta*B (every group pays alpha, the last group's transfer cannot hide behind
    backward); total/min_groups keeps enough groups to overlap with backward, unless the floor says
    the model is too small for that."""
    alpha, beta = cost.alpha_s, cost.beta_s_per_byte
    if beta <= 0:
        raise ValueError("the cost model needs a positive beta (seconds per byte)")
    latency_floor = alpha / (max_overhead * beta)
    best_tradeoff = math.sqrt(alpha * max(total_bytes, 0) / beta)
    overlap_cap = max(total_bytes, 0) / max(1, min_groups)
    chosen = max(latency_floor, min(best_tradeoff, overlap_cap))
    granule = 64 * KIB
    chosen = int(math.ceil(chosen / granule)) * granule
    return int(min(MAX_AUTO_BUFFER_BYTES, max(MIN_AUTO_BUFFER_BYTES, chosen)))


# --------------------------------------------------------------------------------------------
# Partition


def _greedy_group_count(sizes: Sequence[int], cap: int) -> int:
    """Fewest contiguous groups with every group <= cap (every size must be <= cap)."""
    count, current = 0, 0
    for s in sizes:
        if count == 0 or current + s > cap:
            count += 1
            current = s
        else:
            current += s
    return count


def min_max_bound(sizes: Sequence[int], k: int) -> int:
    """Smallest possible largest group when ``sizes`` is cut into ``k`` contiguous groups."""
    if not sizes:
        return 0
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # integer binary search: greedy feasibility is monotone in the cap
        mid = (lo + hi) // 2
        if _greedy_group_count(sizes, mid) <= k:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _greedy_bounds(sizes: Sequence[int], cap: int, k: int) -> List[Tuple[int, int]]:
    """Exactly k contiguous groups, each <= cap: greedy fill, then halve the largest groups.

    Only for inputs too long for the variance refinement; cap must come from min_max_bound."""
    n = len(sizes)
    bounds, start, current = [], 0, 0
    for i, s in enumerate(sizes):
        if i > start and current + s > cap:
            bounds.append((start, i))
            start, current = i, 0
        current += s
    bounds.append((start, n))
    while len(bounds) < k:  # splitting a group never raises the largest one
        splittable = [j for j, (a, b) in enumerate(bounds) if b - a > 1]
        j = max(splittable, key=lambda t: (sum(sizes[bounds[t][0]:bounds[t][1]]), -t))
        a, b = bounds[j]
        half, running, cut = sum(sizes[a:b]) / 2, 0, a + 1
        for i in range(a, b - 1):
            running += sizes[i]
            cut = i + 1
            if running >= half:
                break
        bounds[j:j + 1] = [(a, cut), (cut, b)]
    return bounds


def balanced_bounds(sizes: Sequence[int], k: int) -> List[Tuple[int, int]]:
    """Cut ``sizes`` into ``k`` contiguous groups: smallest largest group, then least variance.

    Returns half-open (start, end) index pairs. The first criterion is exact (binary search on the
    cap); among partitions reaching it, a DP picks the one with the smallest sum of squared group
    sizes (the same as the smallest spread around the mean). Ties go to the earliest cut, so the
    result is deterministic."""
    n = len(sizes)
    if n == 0:
        return []
    k = max(1, min(int(k), n))
    if k == 1:
        return [(0, n)]
    cap = min_max_bound(sizes, k)
    if n * n * k > _REFINE_WORK_LIMIT or n > _REFINE_MAX_TENSORS:
        return _greedy_bounds(sizes, cap, k)
    prefix = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    width = prefix[None, :] - prefix[:, None]  # width[i, j] = bytes of items i..j-1
    idx = np.arange(n + 1)
    feasible = (idx[:, None] < idx[None, :]) & (width <= cap)
    scale = float(cap) if cap > 0 else 1.0  # squares of width/cap stay <= 1: no float overflow
    cost = np.where(feasible, (width / scale) ** 2, np.inf)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((k, n + 1), dtype=np.int64)
    for g in range(k):
        total = best[:, None] + cost
        choice[g] = np.argmin(total, axis=0)  # first minimum: earliest cut wins ties
        best = total[choice[g], idx]
    if not np.isfinite(best[n]):  # cannot happen with cap from min_max_bound; keep it loud
        raise AssertionError("balanced partition found no feasible cut")
    bounds, end = [], n
    for g in range(k - 1, -1, -1):
        start = int(choice[g][end])
        bounds.append((start, end))
        end = start
    bounds.reverse()
    return bounds


def partition_sizes(sizes: Sequence[int], buffer_bytes: int) -> List[Tuple[int, int]]:
    """Cut a ready-ordered size list into contiguous, balanced groups for ``buffer_bytes``.

    A size above the buffer is a group of its own and splits the list into segments. Each segment
    gets the fewest groups that keep every group <= buffer (at least ceil(segment/buffer)), cut by
    :func:`balanced_bounds`. A segment smaller than half a buffer would only make an under-filled
    buffer, so it rides along with the oversized tensor after it (or before it, at the end)."""
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    n = len(sizes)
    oversized = [i for i, s in enumerate(sizes) if s > buffer_bytes]
    # Pieces in order: ("segment", start, end) and ("big", i, i+1).
    pieces: List[List[Any]] = []
    start = 0
    for i in oversized:
        if i > start:
            pieces.append(["segment", start, i])
        pieces.append(["big", i, i + 1])
        start = i + 1
    if start < n:
        pieces.append(["segment", start, n])
    if oversized:
        merged: List[List[Any]] = []
        carry: Optional[int] = None  # start of a small segment waiting for the next oversized tensor
        for kind, a, b in pieces:
            small = kind == "segment" and sum(sizes[a:b]) < buffer_bytes / 2
            if kind == "segment" and small and any(p[0] == "big" for p in pieces if p[1] >= b):
                carry = a
                continue
            if kind == "segment" and small:  # trailing small segment: join the previous big one
                merged[-1][2] = b
                continue
            if kind == "big" and carry is not None:
                a, carry = carry, None
            merged.append([kind, a, b])
        pieces = merged
    bounds: List[Tuple[int, int]] = []
    for kind, a, b in pieces:
        if kind == "big":
            bounds.append((a, b))
            continue
        segment = list(sizes[a:b])
        k = _greedy_group_count(segment, buffer_bytes)
        bounds.extend((a + s, a + e) for s, e in balanced_bounds(segment, k))
    return bounds


# --------------------------------------------------------------------------------------------
# Profiling


@dataclasses.dataclass
class GradientProfile:
    """What a few backward passes showed: sizes, dtypes and the order gradients became ready."""

    names: List[str]  # unique trainable parameters, model order
    shapes: Dict[str, List[int]]
    dtypes: Dict[str, str]
    grad_bytes: Dict[str, int]
    ready_order: List[str]  # parameters that received a gradient, earliest first
    unused: List[str]  # parameters that never received a gradient, model order


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def unique_trainable_parameters(
        model_or_named: Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]]]
) -> List[Tuple[str, torch.Tensor]]:
    """(name, parameter) for every trainable parameter, each shared tensor once under its first name."""
    named = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) \
        else model_or_named
    seen, out = set(), []
    for name, p in named:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def _call_model(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _floating_tensors(output: Any) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() or output.is_complex() else []
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _floating_tensors(item)]
    loss = getattr(output, "loss", None)  # model-output objects that carry their loss
    return _floating_tensors(loss) if loss is not None else []


def default_loss(output: Any) -> torch.Tensor:
    """A scalar to backpropagate: the output itself if scalar, else the mean of every float output."""
    tensors = [t for t in _floating_tensors(output) if t.requires_grad]
    if not tensors:
        raise ValueError("the model output has no floating-point tensor that requires grad; "
                         "pass loss_fn to make_plan")
    if len(tensors) == 1 and tensors[0].dim() == 0:
        return tensors[0].float()
    return sum(t.float().mean() if not t.is_complex() else t.abs().float().mean() for t in tensors)


def profile_gradients(model: torch.nn.Module, sample_batch: Any, *, steps: int = 3,
                      loss_fn: Optional[Callable[[Any], torch.Tensor]] = None) -> GradientProfile:
    """Run ``steps`` forward/backward passes and record gradient sizes and ready order.

    Uses post-accumulate-grad hooks (removed afterwards). The model's gradients, buffers (e.g.
    batch-norm statistics), training flag and the global RNG are restored, so profiling leaves no
    trace on the model."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    params = unique_trainable_parameters(model)
    names = [n for n, _ in params]
    index = {n: i for i, n in enumerate(names)}
    positions: Dict[str, List[int]] = {n: [] for n in names}
    step_clock = [0]
    fired: set = set()

    def make_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if name not in fired:  # first accumulation of this step counts
                fired.add(name)
                positions[name].append(step_clock[0])
                step_clock[0] += 1
        return hook

    handles = []
    for name, p in params:
        if hasattr(p, "register_post_accumulate_grad_hook"):
            handles.append(p.register_post_accumulate_grad_hook(make_hook(name)))
        else:  # older torch: fires when the gradient is computed, just before accumulation
            h = make_hook(name)
            handles.append(p.register_hook(lambda g, _h=h: (_h(g), None)[1]))

    saved_grads = [p.grad for _, p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    cuda_devices = list(range(torch.cuda.device_count())) \
        if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(0)
            model.train()
            for _ in range(steps):
                for _, p in params:
                    p.grad = None
                fired.clear()
                output = _call_model(model, sample_batch)
                loss = loss_fn(output) if loss_fn is not None else default_loss(output)
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        for (_, p), g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, copy in saved_buffers:
                b.copy_(copy)
        model.train(was_training)

    used = [n for n in names if positions[n]]
    # Mean position over the passes, model order breaking ties: stable against the odd reordering.
    ready_order = sorted(used, key=lambda n: (sum(positions[n]) / len(positions[n]), index[n]))
    unused = [n for n in names if not positions[n]]
    shapes = {n: list(p.shape) for n, p in params}
    dtypes = {n: _dtype_name(p.dtype) for n, p in params}
    grad_bytes = {n: int(p.numel() * p.element_size()) for n, p in params}
    return GradientProfile(names, shapes, dtypes, grad_bytes, ready_order, unused)


# --------------------------------------------------------------------------------------------
# Fingerprint and plan


def fingerprint_parameters(
        model_or_named: Union[torch.nn.Module, Iterable[Tuple[str, torch.Tensor]]]
) -> Dict[str, Any]:
    """Names, shapes and dtypes of the unique trainable parameters, with a sha256 over them."""
    entries = [{"name": n, "shape": list(p.shape), "dtype": _dtype_name(p.dtype)}
               for n, p in unique_trainable_parameters(model_or_named)]
    return {"sha256": _fingerprint_hash(entries), "parameters": entries}


def _fingerprint_hash(entries: Sequence[Mapping[str, Any]]) -> str:
    canonical = json.dumps([[e["name"], list(e["shape"]), e["dtype"]] for e in entries],
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


_ELEMENT_BYTES_BY_DTYPE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclasses.dataclass
class Plan:
    """A grouping plan: which parameter gradients are fused together, in ready order.

    ``groups`` lists parameter names (as in ``model.named_parameters()``), earliest-ready group
    first. Parameters that got no gradient while profiling sit in a last group of their own, listed
    in ``unused``; the scheduler leaves that group out and reduces such tensors by threshold."""

    groups: List[List[str]]
    buffer_bytes: int
    world_size: Optional[int]
    fingerprint: Dict[str, Any]
    ready_order: List[str]
    group_bytes: List[int] = dataclasses.field(default_factory=list)
    unused: List[str] = dataclasses.field(default_factory=list)
    predicted_cost: Dict[str, Any] = dataclasses.field(default_factory=dict)

    # -- views ---------------------------------------------------------------------------------

    def parameter_bytes(self) -> Dict[str, int]:
        """Gradient bytes of each planned parameter, from the fingerprint's shapes and dtypes."""
        out = {}
        for e in self.fingerprint.get("parameters", []):
            numel = int(np.prod(e["shape"], dtype=np.int64)) if e["shape"] else 1
            out[e["name"]] = numel * _ELEMENT_BYTES_BY_DTYPE.get(e["dtype"], 4)
        return out

    def is_unused_group(self, group_index: int) -> bool:
        """True for the group that holds the parameters which got no gradient when profiled."""
        group, unused = self.groups[group_index], set(self.unused)
        return bool(group) and all(n in unused for n in group)

    # -- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """The plan as the JSON-ready dict of format version 1."""
        unused = set(self.unused)
        groups = []
        for i, names in enumerate(self.groups):
            group: Dict[str, Any] = {"id": i, "parameters": list(names),
                                     "bytes": int(self.group_bytes[i])}
            if names and all(n in unused for n in names):
                group["unused"] = True
            groups.append(group)
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "buffer_bytes": int(self.buffer_bytes),
            "world_size": self.world_size,
            "ready_order": list(self.ready_order),
            "unused": list(self.unused),
            "groups": groups,
            "predicted_cost": self.predicted_cost,
        }

    def to_json(self) -> str:
        """The plan as JSON text (stable key order, so equal plans give equal text).

        One line per parameter and per group, so the file reads and diffs well."""
        return _dump_json(self.to_dict()) + "\n"

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the plan's JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, source: Union[str, os.PathLike, Mapping[str, Any]]) -> "Plan":
        """Read a plan from a JSON file path or an already-parsed dict; checks format and version."""
        if isinstance(source, Mapping):
            data, where = source, "plan"
        else:
            where = os.fspath(source)
            try:
                with open(where, "r", encoding="utf-8") as f:
                    data = json.load(f)
            except json.JSONDecodeError as exc:
                raise PlanFormatError(f"{where}: not a JSON grouping plan ({exc})") from exc
        return cls._from_dict(data, where)

    @classmethod
    def _from_dict(cls, data: Any, where: str) -> "Plan":
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise PlanFormatError(f"{where}: not a grouping plan (format {found!r}, "
                                  f"expected {PLAN_FORMAT!r})")
        if data.get("version") != PLAN_VERSION:
            raise PlanFormatError(f"{where}: grouping plan version {data.get('version')!r} is not "
                                  f"supported (this fusionring reads version {PLAN_VERSION}); "
                                  f"make the plan again with `fusionring plan`")
        try:
            fingerprint = dict(data["fingerprint"])
            groups_raw = sorted(data["groups"], key=lambda g: int(g["id"]))
            groups = [[str(n) for n in g["parameters"]] for g in groups_raw]
            group_bytes = [int(g["bytes"]) for g in groups_raw]
            plan = cls(
                groups=groups,
                buffer_bytes=int(data["buffer_bytes"]),
                world_size=None if data.get("world_size") is None else int(data["world_size"]),
                fingerprint=fingerprint,
                ready_order=[str(n) for n in data["ready_order"]],
                group_bytes=group_bytes,
                unused=[str(n) for n in data.get("unused", [])]
                or [n for g in groups_raw if g.get("unused") for n in g["parameters"]],
                predicted_cost=dict(data.get("predicted_cost", {})),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"{where}: malformed grouping plan ({exc!r})") from exc
        plan._validate(where)
        return plan

    def _validate(self, where: str) -> None:
        seen: Dict[str, int] = {}
        known = {e["name"] for e in self.fingerprint.get("parameters", [])}
        for i, group in enumerate(self.groups):
            for name in group:
                if name in seen:
                    raise PlanFormatError(f"{where}: parameter {name!r} is in groups {seen[name]} "
                                          f"and {i}")
                seen[name] = i
                if name not in known:
                    raise PlanFormatError(f"{where}: group {i} names {name!r}, which is not in the "
                                          f"plan's fingerprint")
        missing = sorted(known - set(seen))
        if missing:
            raise PlanFormatError(f"{where}: parameters in no group: {', '.join(missing)}")
        if len(self.group_bytes) != len(self.groups):
            raise PlanFormatError(f"{where}: {len(self.group_bytes)} group sizes for "
                                  f"{len(self.groups)} groups")

    # -- checking against a model --------------------------------------------------------------

    def check_model(self, model_or_named: Union[torch.nn.Module,
                                                 Iterable[Tuple[str, torch.Tensor]]]) -> None:
        """Raise :class:`PlanMismatchError` listing every parameter that differs from the plan.

        Compares the model's unique trainable parameters with the fingerprint: missing on either
        side, or a different shape or dtype."""
        current = fingerprint_parameters(model_or_named)
        if current["sha256"] == self.fingerprint.get("sha256"):
            return
        planned = {e["name"]: e for e in self.fingerprint.get("parameters", [])}
        actual = {e["name"]: e for e in current["parameters"]}
        problems = []
        for name, e in planned.items():
            a = actual.get(name)
            if a is None:
                problems.append(f"{name}: in the plan but not a trainable parameter of the model")
                continue
            if list(a["shape"]) != list(e["shape"]):
                problems.append(f"{name}: shape {tuple(e['shape'])} in the plan, "
                                f"{tuple(a['shape'])} in the model")
            if a["dtype"] != e["dtype"]:
                problems.append(f"{name}: dtype {e['dtype']} in the plan, {a['dtype']} in the model")
        for name, a in actual.items():
            if name not in planned:
                problems.append(f"{name}: trainable parameter of the model but not in the plan "
                                f"(shape {tuple(a['shape'])}, {a['dtype']})")
        if problems:  # the same parameters in another order still fit the plan
            raise PlanMismatchError(problems)


def _dump_json(value: Any, indent: int = 0) -> str:
    # Containers of containers are spread over lines; a dict inside a list, or a list of plain
    # values, stays on one line.
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, Mapping) and value:
        items = [f"{inner}{json.dumps(k)}: {_dump_json(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and any(isinstance(v, (Mapping, list)) for v in value):
        items = [f"{inner}{json.dumps(v, separators=(', ', ': '))}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(value, separators=(", ", ": "))


def load_plan(source: Union[None, str, os.PathLike, Mapping[str, Any], Plan] = None
              ) -> Optional[Plan]:
    """A Plan from a path, dict or Plan; None reads ``FUSIONRING_GROUPING_PLAN`` (no plan if unset,
    or set to ``auto``: then DistributedOptimizer makes its groups from the first step)."""
    if isinstance(source, Plan):
        return source
    if source is None:
        from fusionring.config import settings
        source = settings().grouping_plan_path
        if source is None or source == "auto":
            return None
        try:
            return Plan.load(source)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"FUSIONRING_GROUPING_PLAN={source!r}: no such plan file ({exc.strerror})") from None
    return Plan.load(source)


def make_plan(model: torch.nn.Module, sample_batch: Any, *, buffer_bytes: Optional[int] = None,
              world_size: Optional[int] = None, steps: int = 3,
              loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
              probe: Union[None, str, Callable[[int], float], CostModel] = None) -> Plan:
    """Profile ``model`` on ``sample_batch`` and cut its gradients into balanced, ready-ordered groups.

    ``buffer_bytes`` None picks the size with :func:`choose_buffer_bytes` from the cost model that
    ``probe`` gives (:func:`cost_model_from_probe`; ``"mpi"`` is collective). Same model, same
    batch: same plan."""
    profile = profile_gradients(model, sample_batch, steps=steps, loss_fn=loss_fn)
    cost = cost_model_from_probe(probe, world_size)
    sizes = [profile.grad_bytes[n] for n in profile.ready_order]
    total = sum(sizes)
    if buffer_bytes is None:
        buffer_bytes = choose_buffer_bytes(total, cost)
    buffer_bytes = int(buffer_bytes)
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")

    groups = [profile.ready_order[a:b] for a, b in partition_sizes(sizes, buffer_bytes)]
    if profile.unused:
        groups.append(list(profile.unused))
    group_bytes = [sum(profile.grad_bytes[n] for n in g) for g in groups]
    # The unused group is never reduced while the model behaves as profiled: it costs nothing.
    per_group = [cost.seconds(b) for b in group_bytes]
    if profile.unused:
        per_group[-1] = 0.0
    fingerprint = fingerprint_parameters(model)
    return Plan(
        groups=groups,
        buffer_bytes=buffer_bytes,
        world_size=world_size,
        fingerprint=fingerprint,
        ready_order=list(profile.ready_order) + list(profile.unused),
        group_bytes=group_bytes,
        unused=list(profile.unused),
        predicted_cost={
            "alpha_s": cost.alpha_s,
            "beta_s_per_byte": cost.beta_s_per_byte,
            "source": cost.source,
            "per_step_s": sum(per_group),
            "per_group_s": per_group,
        },
    )


# --------------------------------------------------------------------------------------------
# Summary and command line


def format_bytes(nbytes: float) -> str:
    """1536 -> '1.50 KiB' (two decimals, as plan summaries line them up)."""
    return units.format_bytes(nbytes, decimals=2)


def summarize(plan: Plan, max_rows: int = 40) -> str:
    """A short table of the plan's groups and how evenly they are filled."""
    lines = []
    n_params = sum(len(g) for g in plan.groups)
    used = [b for i, b in enumerate(plan.group_bytes) if not plan.is_unused_group(i)]
    lines.append(f"{len(plan.groups)} groups of {n_params} parameters, "
                 f"{format_bytes(sum(plan.group_bytes))} of gradients, "
                 f"buffer {format_bytes(plan.buffer_bytes)}"
                 + (f", world size {plan.world_size}" if plan.world_size else ""))
    lines.append(f"{'group':>6} {'tensors':>8} {'bytes':>12} {'of buffer':>10}")
    rows = list(range(len(plan.groups)))
    if len(rows) > max_rows:
        rows = rows[:max_rows // 2] + [-1] + rows[-max_rows // 2:]
    for i in rows:
        if i < 0:
            lines.append(f"{'...':>6}")
            continue
        note = "  (no gradient when profiled)" if plan.is_unused_group(i) else ""
        b = plan.group_bytes[i]
        lines.append(f"{i:>6} {len(plan.groups[i]):>8} {format_bytes(b):>12} "
                     f"{100.0 * b / plan.buffer_bytes:>9.1f}%{note}")
    if used:
        arr = np.asarray(used, dtype=np.float64)
        cv = float(arr.std() / arr.mean()) if arr.mean() > 0 else 0.0
        lines.append(f"spread: min {format_bytes(arr.min())}, max {format_bytes(arr.max())}, "
                     f"mean {format_bytes(arr.mean())}, coefficient of variation {cv:.3f}")
        sizes = plan.parameter_bytes()
        over = sum(1 for g in plan.groups if any(sizes.get(n, 0) > plan.buffer_bytes for n in g))
        if over:
            lines.append(f"{over} group{'s hold' if over != 1 else ' holds'} a tensor larger than "
                         f"the buffer")
    pc = plan.predicted_cost
    if pc:
        lines.append(f"predicted allreduce time per step: {pc['per_step_s'] * 1e3:.3f} ms "
                     f"(alpha {pc['alpha_s'] * 1e6:.1f} us, "
                     f"{1.0 / pc['beta_s_per_byte'] / 1e9:.2f} GB/s, {pc.get('source', '?')})")
    return "\n".join(lines)


def _import_attribute(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"fusionring plan: {what} must look like MODULE:NAME, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"fusionring plan: cannot import {module_name!r} for {what} ({spec}): "
                         f"{type(exc).__name__}: {exc}; MODULE is imported from the current "
                         f"directory or sys.path") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SystemExit(f"fusionring plan: module {module_name!r} has no {attr!r} "
                             f"({what}, {spec})")
        obj = getattr(obj, part)
    return obj


def _user_call(what: str, hint: str, function: Callable[[], Any]) -> Any:
    """Run user code (the factory, the batch function, the model); its failure exits with one
    line naming what failed and how to fix the call, instead of a traceback through ours."""
    try:
        return function()
    except Exception as exc:  # any error of the user's code
        raise SystemExit(f"fusionring plan: {what} failed: {type(exc).__name__}: {exc}"
                         f"{hint}") from None


def _parse_shape(text: str) -> List[int]:
    try:
        shape = [int(x) for x in text.replace("x", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch shape must be integers like 32,64, got {text!r}")
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"batch shape must be positive integers, got {text!r}")
    return shape


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` subcommand's arguments to ``parser``."""
    parser.add_argument("model", metavar="MODULE:FACTORY",
                        help="FACTORY() returns the torch.nn.Module to plan for; MODULE is imported "
                             "from the current directory or sys.path")
    batch = parser.add_mutually_exclusive_group(required=True)
    batch.add_argument("--batch-shape", type=_parse_shape, metavar="D0,D1,...",
                       help="shape of a random float32 sample batch (seeded), e.g. 32,64")
    batch.add_argument("--batch-fn", metavar="MODULE:FUNC",
                       help="FUNC() returns the sample batch (a tensor, a tuple of positional "
                            "arguments or a dict of keyword arguments)")
    parser.add_argument("--buffer-mb", type=float, default=None,
                        help="fusion-buffer size in MiB (1024*1024 bytes); default: chosen from "
                             "the allreduce cost model")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks the plan is for (feeds the default cost model)")
    parser.add_argument("--steps", type=int, default=3, help="profiling passes (default 3)")
    parser.add_argument("--probe", choices=("default", "mpi"), default="default",
                        help="cost model: built-in defaults, or time MPI Allreduce (run under "
                             "mpiexec; every rank takes part, rank 0 writes the plan)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batch")
    parser.add_argument("-o", "--output", required=True, help="where to write the plan JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="print no summary")


def run_command(args: argparse.Namespace) -> int:
    """Run ``fusionring plan`` with parsed arguments; returns the exit status."""
    factory = _import_attribute(args.model, "the model")
    model = _user_call(f"{args.model}()", "", factory)
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"fusionring plan: {args.model}() returned {type(model).__name__}, "
                         f"not a torch.nn.Module")
    if args.batch_fn:
        batch = _user_call(f"{args.batch_fn}()", "", _import_attribute(args.batch_fn, "--batch-fn"))
        described = f"the batch from {args.batch_fn}()"
    else:
        generator = torch.Generator().manual_seed(args.seed)
        batch = torch.randn(args.batch_shape, generator=generator, dtype=torch.float32)
        first = next(iter(model.parameters()), None)
        if first is not None:
            batch = batch.to(first.device)
        described = f"a random float32 batch of shape {tuple(args.batch_shape)}"
    # One forward pass first, so that a batch the model cannot take is reported as such.
    with torch.no_grad():
        _user_call(f"running {args.model}() on {described}",
                   "; check --batch-shape (or give --batch-fn)",
                   lambda: _call_model(model, batch))
    buffer_bytes = None if args.buffer_mb is None else int(round(args.buffer_mb * MIB))
    if buffer_bytes is not None and buffer_bytes <= 0:
        raise SystemExit("fusionring plan: --buffer-mb must be positive")
    rank, world_size = 0, args.world_size
    if args.probe == "mpi":
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
        if world_size is None:
            world_size = MPI.COMM_WORLD.Get_size()
    plan = make_plan(model, batch, buffer_bytes=buffer_bytes, world_size=world_size,
                     steps=args.steps, probe=None if args.probe == "default" else args.probe)
    if rank == 0:
        plan.save(args.output)
        if not args.quiet:
            print(summarize(plan))
            print(f"wrote {args.output}")
    return 0
