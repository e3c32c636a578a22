"""N:M structured gradient sparsification with packed masks (SPEC section 2, seed 004).

In every run of M adjacent gradient values the N of largest magnitude are kept; the kept
values travel (float32, float16 or bfloat16) and, where ranks' choices differ, so does a
bit mask with one bit per element packed into 64-bit words. The C++ kernels
(``csrc/nm_sparse.*``) define the selection rule bit-exactly: magnitude compared on the bits
of |x|, equal magnitudes go to the lower index, and a tail group of L < M values keeps
min(N, L) of them.

Two ways to reduce (``shared_mask``):

* ``True`` (default): every rank uses the same mask, so the kept values are summable and the
  plain ring reduces a buffer N/M the size (no mask on the wire). The mask comes from data
  that is identical on all ranks: per tensor, an estimate of the reduced gradient's
  per-step magnitude. Positions sent at a step take their new reduced value divided by
  (1 + steps they waited); positions not sent keep their last estimate and their wait grows,
  and a position's score is |estimate| * (1 + wait) -- the size its error-feedback residual
  is expected to have reached -- so unsent positions rise until they are sent. The first
  reduction of a tensor (no estimate yet) is sent dense.
* ``False`` (the seed's per-rank masks): every rank selects on its own data; the C++ core runs
  a compressed reduce-scatter (each hop unpacks, adds, re-selects N of M, and keeps what it
  dropped as this rank's residual) and an allgather of the compressed reduced chunks.

Error feedback (on by default): what a step does not deliver is added back at the next step,
so the sum over ranks of everything sent plus all residuals equals the sum of all gradients.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _C
from ..dtypes import VALUE_CODES, contiguous_view, dtype_name
from ..reduction import ReductionContext
from ..timeline import phase_recorder
from .base import Compressor, Memory, check_flag, check_floating, register_compressor, working_copy
# The kernels and schedules keep their names here too (``fusionring.compression.nm.gather``).
from .nm_kernels import (MAX_M, _squares, bits_per_element, check_nm, check_values,
                         compress_values, cuda_kernels, gather, mask_to_bool, scatter,
                         select_mask)
from .nm_codec import NmCodec
from .nm_schedules import ADAPTIVE_THRESHOLDS, AdaptiveSchedule, StepSchedule
from .pipeline import run_pipeline, split_chunks

__all__ = ["NMCompressor", "nm", "StepSchedule", "AdaptiveSchedule", "ADAPTIVE_THRESHOLDS",
           "MAX_M", "PIPELINE_CHUNK_ELEMENTS", "VALUE_CODES", "bits_per_element", "check_nm",
           "check_values", "compress_values", "cuda_kernels", "gather", "mask_to_bool",
           "scatter", "select_mask"]


# The shared-mask reduction runs as a pipeline over chunks of about this many dense elements:
# while the ring carries one chunk, a helper thread encodes the next and decodes the one
# before, so that CPU work hides behind the transfer instead of adding to it. Chunks are
# large enough (1 MiB of float16 values for 2:4) that per-message costs stay small.
PIPELINE_CHUNK_ELEMENTS = 1 << 20


# ---------------------------------------------------------------------- the compressor
@dataclasses.dataclass
class _TensorState:
    step: int = 0                              # reductions of this tensor so far
    estimate: Optional[torch.Tensor] = None    # shared mask: per-step reduced magnitude
    wait: Optional[torch.Tensor] = None        # shared mask: steps since each element was sent
    level: int = 0                             # adaptive: index into the levels
    ema: Optional[float] = None                # adaptive: smoothed residual ratio
    since: int = 0                             # adaptive: reductions at this level


@dataclasses.dataclass
class _Context:
    key: Optional[str]
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    count: int
    mask: Optional[torch.Tensor]  # None: the payload is dense
    nm: Tuple[int, int] = (0, 0)
    # Adaptive schedule: this rank's squared residual and squared compensated input, for a
    # caller that sums them over its ranks (``observe``) so that every rank moves in step.
    squares: Optional[Tuple[float, float]] = None


def _dense_residual(x: torch.Tensor, sent: torch.Tensor, out: torch.Tensor) -> None:
    """What sending all of `x` as `sent` (its values dtype) loses, into `out`. As in the
    kernels, a residual that is not finite (a non-finite gradient, or one beyond float16's
    range) is kept as 0: carried on, it would spoil every later step of its element."""
    torch.sub(x, sent.float(), out=out)
    torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)


def _squares_where(t: torch.Tensor):
    """Sum of squares in double: a host float for host tensors, a device scalar on a GPU
    (read with the others in one copy by _adapt)."""
    if t.device.type == "cpu":
        return _squares(t)
    return t.double().square().sum()


@dataclasses.dataclass(eq=False)
class _Segment:
    """One tensor of a fused shared-mask reduction."""

    key: Optional[str]
    state: _TensorState
    x: torch.Tensor                      # flat float32, reduced in place
    n: int
    m: int
    mask: Optional[torch.Tensor]         # None: sent dense
    stored: Optional[torch.Tensor]       # last step's residual, added in before selection
    residual: Optional[torch.Tensor]     # receives this step's (may be `stored`)
    held: float = 0.0                    # adaptive schedule: squared residual
    total: float = 0.0                   # adaptive schedule: squared compensated input


class NMCompressor(Compressor):
    """N:M sparsification as a Horovod compressor that also reduces inside the runtime.

    ``Compression.nm(n=2, m=4, values=torch.float32, shared_mask=True, error_feedback=True,
    schedule=None)``. With DistributedOptimizer and hvd.allreduce it runs on the runtime's
    background thread (``in_runtime``), keyed by tensor name. On its own:
    ``payload, ctx = c.compress(t, name=...)`` then ``c.decompress(payload, ctx)``; the payload
    is the kept values (shared mask: summable) or (values, mask words) (per-rank masks).
    """

    summable = None       # shared mask: the kept values; per-rank masks: (values, mask words)
    in_runtime = True
    stateful = True       # residuals, mask estimates, schedule positions
    named = True          # ... kept per tensor name

    def __init__(self, n: int = 2, m: int = 4, values: torch.dtype = torch.float32,
                 shared_mask: bool = True, error_feedback: bool = True,
                 schedule: Union[None, str, Sequence, StepSchedule, AdaptiveSchedule] = None
                 ) -> None:
        self.n, self.m = check_nm(n, m)
        self.values = check_values(values)
        self.shared_mask = check_flag("Compression.nm", "shared_mask", shared_mask)
        self.error_feedback = check_flag("Compression.nm", "error_feedback", error_feedback)
        if schedule is None or isinstance(schedule, (StepSchedule, AdaptiveSchedule)):
            self.schedule = schedule
        elif schedule == "adaptive":
            self.schedule = AdaptiveSchedule.halving(
                self.n, self.m, **ADAPTIVE_THRESHOLDS["shared" if shared_mask else "per-rank"])
        elif isinstance(schedule, str):
            raise ValueError(f"unknown N:M schedule {schedule!r}: use 'adaptive' or a list of "
                             f"(step, (n, m))")
        else:
            self.schedule = StepSchedule(schedule, (self.n, self.m))
        self.memory = Memory()
        self._tensors: Dict[str, _TensorState] = {}
        self._lock = threading.RLock()
        self.stats = {"reductions": 0, "dense_bytes": 0, "payload_bytes": 0, "wire_bytes": 0}
        # Standalone compress() moves the adaptive schedule on this rank's own statistics; a
        # caller that sums them over its ranks first (a DDP hook) turns this off and calls
        # observe() with the sums.
        self.adapt_locally = True

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        """Agreed across ranks (negotiation): differing configurations fail loudly."""
        mode = "shared" if self.shared_mask else "per-rank"
        plan = "" if self.schedule is None else f",{type(self.schedule).__name__}"
        return (f"nm({self.n}:{self.m},{dtype_name(self.values)},{mode},"
                f"ef={int(self.error_feedback)}{plan})")

    def __repr__(self) -> str:
        return f"Compression.{self.name}"

    def level(self, name: str) -> Tuple[int, int]:
        """The (n, m) the next reduction of tensor `name` will use: the name given to
        ``allreduce`` (a parameter's name under ``DistributedOptimizer``) or the state's key
        (``"allreduce.<name>"``, a DDP bucket's key). A tensor not reduced yet starts at the
        first level."""
        with self._lock:
            state = self._tensors.get(name) or self._tensors.get(f"allreduce.{name}")
            return self._level(state or _TensorState())

    def reduces_on_gpu(self, tensor: torch.Tensor) -> bool:
        """Reduce on the GPU with the CUDA kernels when every level can: per-rank masks on
        the compressed ring (NCCL between hops), a shared mask (and dense stages) as one NCCL
        sum of the kept values. The adaptive schedule's squared sums stay on the device until
        one copy of them all per batch."""
        if not getattr(_C, "nm_cuda_built", False):
            return False
        if self.schedule is None:
            levels = [(self.n, self.m)]
        elif isinstance(self.schedule, AdaptiveSchedule):
            levels = list(self.schedule.levels)
        else:
            levels = [self.schedule.initial] + [nm for _, nm in self.schedule.stages]
        return all(n == m or 32 % m == 0 for n, m in levels)

    def _level(self, state: _TensorState) -> Tuple[int, int]:
        if self.schedule is None:
            return self.n, self.m
        if isinstance(self.schedule, AdaptiveSchedule):
            return self.schedule.levels[state.level]
        return self.schedule.at(state.step)

    def _state(self, key: Optional[str]) -> _TensorState:
        if key is None:
            return _TensorState()
        return self._tensors.setdefault(key, _TensorState())

    # ------------------------------------------------------------------ Horovod shape
    def compress(self, tensor: torch.Tensor, name: Optional[str] = None, scratch: bool = False):
        """Encode `tensor` -> (payload, ctx). State (residual, mask estimate, step) is kept per
        `name`; without one it is kept per shape and dtype, so name distinct tensors.
        `scratch=True`: the caller lets a float32 contiguous `tensor` be overwritten (a DDP
        bucket that the decoded result replaces), which saves copying it."""
        check_floating("Compression.nm", tensor, name)
        key = name if name is not None else f"{tuple(tensor.shape)}:{tensor.dtype}"
        with self._lock:
            state = self._state(key)
            n, m = self._level(state)
            # CUDA tensors stay on the device when the GPU kernels can take them.
            device = tensor.device if cuda_kernels(tensor, m) else torch.device("cpu")
            x = working_copy(tensor, device, scratch)
            count = x.numel()
            residual = self.memory.compensate_for_new(key, x) if self.error_feedback else None
            if self.shared_mask:
                mask = self._shared_mask(state, n, m, count, device)
                if mask is None:
                    kept = x.to(self.values)
                    if residual is not None:
                        _dense_residual(x, kept, residual)
                else:
                    kept = gather(x, mask, self.values, residual, nm=(n, m))
                payload: Any = kept
            else:
                kept, mask = compress_values(x, n, m, self.values, residual)
                payload = (kept, mask)
            if residual is not None:
                self.memory.update(key, residual)
            squares = self._observe_local(state, residual, x)
            state.step += 1
        return payload, _Context(key, tensor.shape, tensor.dtype, tensor.device, count, mask,
                                 (n, m), squares)

    def decompress(self, payload, ctx, out: Optional[torch.Tensor] = None):
        """Rebuild the dense tensor; ctx None (the in-runtime path) returns it unchanged.
        `out`: a tensor of the original's shape to write the result into, and return."""
        if ctx is None:
            return payload
        # The dense float32 result is written straight into `out` where it can be.
        into = None
        if out is not None:
            if out.numel() != ctx.count:
                raise ValueError(f"decompress: out holds {out.numel()} values, the tensor had "
                                 f"{ctx.count}")
            if out.dtype == torch.float32 and out.is_contiguous():
                into = out.reshape(-1)
        if ctx.mask is None and not isinstance(payload, (tuple, list)):  # sent dense
            if into is not None:
                dense = into.copy_(payload.detach().reshape(-1))
            else:
                dense = payload.detach().to(torch.float32).reshape(-1).clone()
        else:
            if isinstance(payload, (tuple, list)):  # per-rank: the mask travels along
                kept, mask = payload
                mask = mask.to(kept.device)
            else:
                kept, mask = payload.detach().to(ctx.mask.device), ctx.mask
            if into is not None and into.device != kept.device:
                into = None
            dense = scatter(kept.contiguous(), mask.contiguous(), ctx.count, out=into, nm=ctx.nm)
        if self.shared_mask and ctx.key is not None:
            with self._lock:
                self._update_estimate(self._state(ctx.key), dense, ctx.mask)
        result = dense.reshape(ctx.shape).to(device=ctx.device, dtype=ctx.dtype)
        if out is None:
            return result
        if result.data_ptr() != out.data_ptr():
            out.copy_(result.reshape(out.shape))
        return out

    # ------------------------------------------------------------------ shared-mask bookkeeping
    def _shared_mask(self, state: _TensorState, n: int, m: int, count: int,
                     device: torch.device = torch.device("cpu")) -> Optional[torch.Tensor]:
        """The mask every rank derives alike, or None to send dense (no estimate yet, n == m)."""
        if not self._masked(state, n, m, count):
            return None
        if state.estimate.device != device:
            state.estimate, state.wait = state.estimate.to(device), state.wait.to(device)
        if device.type == "cpu":  # one fused pass, no full-size score tensor
            mask = torch.empty(_C.nm_mask_words(count), dtype=torch.int64)
            _C.nm_select_by_wait(state.estimate.data_ptr(), state.wait.data_ptr(), count, n, m,
                                 mask.data_ptr())
            return mask
        score = state.estimate.abs().mul_(state.wait + 1.0)
        return select_mask(score, n, m)

    @staticmethod
    def _masked(state: _TensorState, n: int, m: int, count: int) -> bool:
        return n != m and state.estimate is not None and state.estimate.numel() == count

    @staticmethod
    def _update_estimate(state: _TensorState, reduced: torch.Tensor,
                         mask: Optional[torch.Tensor]) -> None:
        if mask is None or state.estimate is None or state.estimate.numel() != reduced.numel():
            state.estimate = reduced.detach().clone()
            state.wait = torch.zeros_like(state.estimate)
            return
        if state.estimate.device != reduced.device:
            state.estimate = state.estimate.to(reduced.device)
            state.wait = state.wait.to(reduced.device)
        if reduced.device.type == "cpu":
            reduced = reduced.reshape(-1).contiguous()
            _C.nm_track(state.estimate.data_ptr(), state.wait.data_ptr(), reduced.data_ptr(),
                        mask.data_ptr(), reduced.numel())
            return
        sent = mask_to_bool(mask.to(reduced.device), reduced.numel())
        state.estimate = torch.where(sent, reduced / (state.wait + 1.0), state.estimate)
        state.wait = torch.where(sent, torch.zeros_like(state.wait), state.wait + 1.0)

    def _observe_local(self, state: _TensorState, residual: Optional[torch.Tensor],
                       x: torch.Tensor) -> Optional[Tuple[float, float]]:
        """The adaptive schedule's squared sums of this compression (None without one), and
        the schedule moved on them when it adapts locally."""
        if not isinstance(self.schedule, AdaptiveSchedule):
            return None
        held = _squares(residual) if residual is not None else 0.0
        total = _squares(x)
        if self.adapt_locally:
            self.schedule.observe(state, held / max(total, 1e-300))
        return held, total

    def observe(self, ctx: _Context, held: float, total: float) -> None:
        """Move the adaptive schedule of `ctx`'s tensor on squared sums taken over the ranks
        (``ctx.squares`` summed), so that every rank picks the same next level."""
        if isinstance(self.schedule, AdaptiveSchedule) and ctx.key is not None:
            with self._lock:
                self.schedule.observe(self._state(ctx.key), held / total if total > 0 else 0.0)

    # ------------------------------------------------------------------ runtime path
    def communicate(self, job: ReductionContext) -> int:
        """Reduce the batch's outputs in place (the runtime's background thread); returns the
        bytes this rank sent. Each output is read and written where it lies."""
        if job.core_op != 0:
            raise ValueError(f"Compression.nm reduces with Sum or Average only (tensor "
                             f"'{job.names[0]}')")
        outputs = job.outputs
        sizes = [out.numel() for out in outputs]
        views = [out if out.dtype == torch.float32 else out.float() for out in outputs]
        keys = job.keys
        with self._lock:
            wire_before = self.stats["wire_bytes"]
            levels = [self._level(self._state(key)) for key in keys]
            ratios: List[Tuple[_TensorState, float, float]] = []
            if self.shared_mask:
                self._shared_reduce_where(job, views, keys, levels, ratios)
            else:
                start = 0
                while start < len(views):  # runs of equal (n, m) reduce together
                    end = start + 1
                    while end < len(views) and levels[end] == levels[start]:
                        end += 1
                    self._per_rank_reduce(job, views[start:end], keys[start:end],
                                          levels[start], ratios)
                    start = end
            if isinstance(self.schedule, AdaptiveSchedule) and ratios:
                self._adapt(job, ratios)
            for key in keys:
                if key is not None:
                    self._tensors[key].step += 1
            self.stats["reductions"] += 1
            self.stats["dense_bytes"] += sum(sizes) * 4
            wire = self.stats["wire_bytes"] - wire_before
        for out, view in zip(outputs, views):
            if view is not out:  # a 16-bit gradient was reduced in float32
                out.copy_(view)
        return wire

    def _shared_reduce_where(self, job: ReductionContext, views, keys, levels, ratios) -> None:
        """The shared-mask reduction where the batch lies: on a GPU in one pass, on the host
        pipelined over a helper thread."""
        if views and views[0].is_cuda:
            self._shared_reduce_one_pass(job, views, keys, levels, job.device_allreduce, ratios)
        else:
            self._shared_reduce(job, views, keys, levels, ratios)

    def _shared_reduce_one_pass(self, job: ReductionContext, views, keys, levels,
                                allreduce: Callable[[torch.Tensor], None],
                                ratios: Optional[list] = None) -> None:
        """The shared-mask reduction as a GPU runs it, in stream order on any device: each
        tensor is compensated, its kept values selected by the shared mask (all of it before
        a mask exists) and packed into one payload, which `allreduce` sums in place; the sum
        is scaled and scattered back and the estimates tracked. The same steps and bits as
        _shared_reduce, without its pipeline (no host thread between GPU kernels). The
        adaptive schedule's squared sums are taken over the pipeline's pieces, in its order."""
        prescale, postscale = job.prescale, job.postscale
        adaptive = isinstance(self.schedule, AdaptiveSchedule) and ratios is not None
        plans, parts = [], []
        for x, key, (n, m) in zip(views, keys, levels):
            state = self._state(key)
            numel = x.numel()
            if prescale != 1.0:
                x.mul_(prescale)
            residual = None
            if self.error_feedback and key is not None:
                stored = self.memory.fitting(key, numel)
                if stored is not None:
                    x.add_(stored.to(x.device).reshape(x.shape))
                residual = torch.empty(numel, device=x.device)
            mask = self._shared_mask(state, n, m, numel, x.device)
            if mask is None:
                kept = x.to(self.values, copy=True)
                if residual is not None:
                    _dense_residual(x, kept, residual)
            else:
                kept = gather(x, mask, self.values, residual, nm=(n, m))
            if adaptive and key is not None:
                step = max(64 * m, PIPELINE_CHUNK_ELEMENTS // 4 // (64 * m) * 64 * m)
                held = total = 0.0
                for lo in range(0, numel, step):
                    if residual is not None:
                        held = held + _squares_where(residual[lo:lo + step])
                    total = total + _squares_where(x[lo:lo + step])
                ratios.append((state, held, total))
            plans.append((key, state, x, n, m, mask, residual))
            parts.append(kept)
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=self.values)
        if payload.numel():
            allreduce(payload)
        at = 0
        for (key, state, x, n, m, mask, residual), kept in zip(plans, parts):
            part = payload[at:at + kept.numel()]
            at += kept.numel()
            if postscale != 1.0:  # scale the N/M values, not the dense result: same bits
                part = part.float() if part.dtype != torch.float32 else part
                part.mul_(postscale)
            if mask is None:
                x.copy_(part)
            else:
                scatter(part.contiguous(), mask, x.numel(), out=x, nm=(n, m))
            if residual is not None:
                self.memory.update(key, residual)
            if key is not None:
                self._update_estimate(state, x, mask)
        size = job.size
        sent = payload.numel() * payload.element_size()
        self.stats["payload_bytes"] += sent
        self.stats["wire_bytes"] += sent * 2 * (size - 1) // max(size, 1)

    def _shared_reduce(self, job: ReductionContext, views, keys, levels, ratios) -> None:
        prescale, postscale = job.prescale, job.postscale
        code = VALUE_CODES[self.values]
        esize = torch.empty(0, dtype=self.values).element_size()
        adaptive = isinstance(self.schedule, AdaptiveSchedule)
        segments: List[_Segment] = []
        pieces: List[Tuple[_Segment, int, int, int, int]] = []  # segment, lo, hi, payload at, kept
        total = 0
        for x, key, (n, m) in zip(views, keys, levels):
            state = self._state(key)
            numel = x.numel()
            mask = None
            if self._masked(state, n, m, numel):  # selected a chunk at a time by the pipeline
                mask = torch.empty(_C.nm_mask_words(numel), dtype=torch.int64)
                if state.estimate.is_cuda:
                    state.estimate, state.wait = state.estimate.cpu(), state.wait.cpu()
            stored = residual = None
            if self.error_feedback and key is not None:
                stored = self.memory.fitting(key, numel)
                if stored is not None:
                    stored = stored.cpu().reshape(x.shape)
                # what was held back last step is added in, then the buffer holds this step's
                residual = stored if stored is not None else torch.empty(numel)
            seg = _Segment(key, state, x, n, m, mask, stored, residual)
            segments.append(seg)
            # Pieces start on whole mask words and whole groups, so each is selected and
            # packed exactly as the whole tensor would be.
            step = max(64 * m, PIPELINE_CHUNK_ELEMENTS // 4 // (64 * m) * 64 * m)
            for lo in range(0, max(numel, 1), step):
                hi = min(numel, lo + step)
                kept = hi - lo if mask is None else _C.nm_kept_count(hi - lo, n, m)
                pieces.append((seg, lo, hi, total, kept))
                total += kept
        payload = torch.empty(total, dtype=self.values)
        chunks = split_chunks(pieces, sum(x.numel() for x in views), PIPELINE_CHUNK_ELEMENTS)
        record = phase_recorder()  # the timeline's, fetched here: the helper thread has none

        def encode(k: int) -> None:
            started = time.perf_counter()
            for seg, lo, hi, at, kept in chunks[k]:
                x = seg.x[lo:hi]
                if prescale != 1.0:
                    x.mul_(prescale)
                if seg.stored is not None:
                    x.add_(seg.stored[lo:hi])
                part = payload[at:at + kept]
                if seg.mask is None:
                    part.copy_(x)
                    if seg.residual is not None:
                        _dense_residual(x, part, seg.residual[lo:hi])
                else:
                    words = seg.mask.data_ptr() + lo // 64 * 8
                    _C.nm_select_by_wait(seg.state.estimate.data_ptr() + 4 * lo,
                                         seg.state.wait.data_ptr() + 4 * lo, hi - lo, seg.n,
                                         seg.m, words)
                    _C.nm_gather(x.data_ptr(), 0, hi - lo, words, part.data_ptr(), code,
                                 0 if seg.residual is None else seg.residual.data_ptr() + 4 * lo)
                if adaptive and seg.key is not None:
                    seg.held += (_squares(seg.residual[lo:hi])
                                 if seg.residual is not None else 0.0)
                    seg.total += _squares(x)
            if record is not None:
                record("compress", started, time.perf_counter())

        def reduce(k: int) -> None:
            lo, hi = chunks[k][0][3], chunks[k][-1][3] + chunks[k][-1][4]
            if hi == lo:  # only empty tensors: the same on every rank
                return
            job.core.allreduce(payload.data_ptr() + lo * esize, hi - lo, code, 0, 1.0, 1.0,
                               job.ring_segment_bytes, job.small_message_bytes)

        def decode(k: int) -> None:
            started = time.perf_counter()
            for seg, lo, hi, at, kept in chunks[k]:
                x = seg.x[lo:hi]
                part = payload[at:at + kept]
                if postscale != 1.0:  # scale the N/M values, not the dense result: same bits
                    part = part.float() if part.dtype != torch.float32 else part
                    part.mul_(postscale)
                if seg.mask is None:
                    x.copy_(part)
                    continue
                words = seg.mask.data_ptr() + lo // 64 * 8
                _C.nm_scatter(part.data_ptr(), VALUE_CODES[part.dtype], words, hi - lo,
                              x.data_ptr(), 0)
                _C.nm_track(seg.state.estimate.data_ptr() + 4 * lo,
                            seg.state.wait.data_ptr() + 4 * lo, x.data_ptr(), words, hi - lo)
            if record is not None:
                record("decompress", started, time.perf_counter())

        run_pipeline(len(chunks), encode, reduce, decode)
        for seg in segments:
            if seg.residual is not None:
                self.memory.update(seg.key, seg.residual)
            if seg.key is not None and seg.mask is None:
                self._update_estimate(seg.state, seg.x, None)
            if adaptive and seg.key is not None:
                ratios.append((seg.state, seg.held, seg.total))
        size = job.size
        self.stats["payload_bytes"] += payload.numel() * payload.element_size()
        self.stats["wire_bytes"] += (payload.numel() * payload.element_size()
                                     * 2 * (size - 1) // max(size, 1))

    def _per_rank_reduce(self, job: ReductionContext, views, keys, level, ratios) -> None:
        n, m = level
        if n == m:  # dense: the shared path with no mask does exactly that
            return self._shared_reduce_where(job, views, keys, [level] * len(views), ratios)
        sizes = [x.numel() for x in views]
        sub = contiguous_view(views)  # one compressed ring over all of them
        if sub is None:
            sub = torch.cat(views)
        offsets = np.cumsum([0] + sizes[:-1]).tolist()
        residual = None
        adaptive = isinstance(self.schedule, AdaptiveSchedule)
        if self.error_feedback:
            residual = torch.empty(sub.numel(), device=sub.device)
            for key, offset, numel in zip(keys, offsets, sizes):
                stored = self.memory.fitting(key, numel)
                part = residual[offset:offset + numel]
                if stored is not None:
                    part.copy_(stored.reshape(-1))
                else:
                    part.zero_()
        if adaptive:  # the compensated input, before the core overwrites the residual
            compensated = sub * job.prescale + (residual if residual is not None else 0.0)
        if sub.is_cuda:  # the same ring and bits on the GPU, NCCL between hops
            out = job.device_ring(sub, NmCodec(n, m, self.values), residual, job.prescale,
                                  job.postscale)
        else:
            out = job.core.nm_allreduce(sub.data_ptr(), sub.numel(), n, m,
                                        VALUE_CODES[self.values],
                                        residual.data_ptr() if residual is not None else 0,
                                        job.prescale, job.postscale, job.ring_segment_bytes)
        if sub.data_ptr() != views[0].data_ptr():  # reduced in a copy
            for x, offset, numel in zip(views, offsets, sizes):
                x.copy_(sub[offset:offset + numel])
        for key, offset, numel in zip(keys, offsets, sizes):
            if key is None:
                continue
            part = slice(offset, offset + numel)
            if residual is not None:
                self.memory.update_from(key, residual[part])
            if adaptive:
                held = (_squares_where(residual[part])
                        if residual is not None else 0.0)
                ratios.append((self._state(key), held,
                               _squares_where(compensated[part])))
        self.stats["payload_bytes"] += (
            _C.nm_kept_count(sub.numel(), n, m) * torch.empty(0, dtype=self.values).element_size()
            + 8 * _C.nm_mask_words(sub.numel()))
        self.stats["wire_bytes"] += out["bytes_sent"]

    def _adapt(self, job: ReductionContext, ratios) -> None:
        # One small float64 sum so every rank sees the same ratios and moves in step.
        values = [v for _, held, total in ratios for v in (held, total)]
        on_device = [v for v in values if isinstance(v, torch.Tensor)]
        if on_device:
            # Sums of tensors on a GPU: one copy of them all to the host, once the batch's
            # kernels have run; the host path's sums are host floats already.
            read = iter(torch.stack(on_device).cpu().tolist())
            values = [next(read) if isinstance(v, torch.Tensor) else v for v in values]
        sums = torch.tensor(values, dtype=torch.float64)
        job.core.allreduce(sums.data_ptr(), sums.numel(), 1, 0, 1.0, 1.0,
                           job.ring_segment_bytes, job.small_message_bytes)
        size = job.size
        self.stats["wire_bytes"] += sums.numel() * 8 * 2 * (size - 1) // max(size, 1)
        for i, (state, _, _) in enumerate(ratios):
            held, total = float(sums[2 * i]), float(sums[2 * i + 1])
            self.schedule.observe(state, held / total if total > 0 else 0.0)

    def forget(self, names) -> None:
        """Drop what is kept for tensors `names` (residual, mask estimate, step), in place.

        Under the lock, in one go: a decode of another tensor running meanwhile (a DDP hook's
        callback on gloo's thread) keeps its update, which a save-and-reload would lose."""
        with self._lock:
            for name in names:
                self._tensors.pop(name, None)
                self.memory.residuals.pop(name, None)

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict:
        schedule = None if self.schedule is None else self.schedule.describe()
        return {"n": self.n, "m": self.m, "values": dtype_name(self.values),
                "shared_mask": self.shared_mask, "error_feedback": self.error_feedback,
                "schedule": schedule}

    def state_dict(self) -> dict:
        """Residuals, mask estimates, steps and schedule positions, for an exact resume."""
        with self._lock:
            return {
                "config": self._config(),
                "residuals": self.memory.state_dict(),
                "tensors": {key: {"step": s.step, "level": s.level, "ema": s.ema,
                                  "since": s.since,
                                  "estimate": None if s.estimate is None else s.estimate.clone(),
                                  "wait": None if s.wait is None else s.wait.clone()}
                            for key, s in self._tensors.items()},
                "stats": dict(self.stats),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved; ValueError when it came from another configuration."""
        saved = state.get("config")
        if saved != self._config():
            raise ValueError(f"N:M state was saved with configuration {saved}, but this "
                             f"compressor is {self._config()}")
        with self._lock:
            self.memory.load_state_dict(state["residuals"])
            self._tensors = {
                key: _TensorState(step=int(s["step"]), level=int(s["level"]), ema=s["ema"],
                                  since=int(s["since"]),
                                  estimate=None if s["estimate"] is None else s["estimate"].clone(),
                                  wait=None if s["wait"] is None else s["wait"].clone())
                for key, s in state["tensors"].items()}
            self.stats = dict(state.get("stats", self.stats))


def nm(n: int = 2, m: int = 4, values: torch.dtype = torch.float32, shared_mask: bool = True,
       error_feedback: bool = True, schedule=None) -> NMCompressor:
    """``Compression.nm(...)``: a new N:M compressor (one per optimizer: it keeps state)."""
    return NMCompressor(n, m, values, shared_mask, error_feedback, schedule)


register_compressor("nm", nm)
