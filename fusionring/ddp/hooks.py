"""fusionring's compressors as ``DistributedDataParallel`` communication hooks.

```python
from fusionring.ddp import hooks
state = hooks.NMState(process_group=None, n=2, m=4, values=torch.float16)
ddp_model.register_comm_hook(state, hooks.nm_hook)
```

Each hook takes DDP's ``GradBucket``, starts one collective of DDP's own process group
(``torch.distributed``: gloo, or NCCL where the GPU kernels exist) and returns its future,
chained with the decoding step. Encoding and decoding use the same C++ kernels as the rest of
fusionring (``fusionring.compression``); nothing here needs MPI or fusionring's runtime. The
collective is started by the hook itself, never from a callback, so every rank starts its
buckets' collectives in bucket order, however many buckets there are.

A new method adds a ``<Method>State`` (a :class:`~fusionring.ddp.state.HookState`) and a
``<method>_hook`` in a file of its own and is imported at the end of this module.
"""
from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.distributed as dist

# The compressor and its schedules by their package names; one kernel wrapper (scatter) for
# decoding the gathered per-rank buckets.
from ..compression import AdaptiveSchedule, NMCompressor, StepSchedule
from ..compression.nm_kernels import scatter
from .state import HookState, bucket_key, mean_into_bucket

__all__ = ["HookState", "NMState", "nm_hook", "ClusterState", "cluster_hook",
           "LayerSelectionState", "layer_selection_hook", "bucket_key"]


def _schedule_from_description(described: Any) -> Union[None, StepSchedule, AdaptiveSchedule]:
    """The schedule ``NMCompressor._config()`` describes (None, stages, or adaptive levels)."""
    if described is None:
        return None
    if isinstance(described, dict):
        return AdaptiveSchedule([tuple(level) for level in described["levels"]],
                                low=described["low"], high=described["high"],
                                smoothing=described["smoothing"], patience=described["patience"])
    return described


class NMState(HookState):
    """State of :func:`nm_hook`: N:M sparsification of each bucket (see docs/nm.md).

    ``shared_mask=True`` (default): every rank derives the same mask from the reduced values it
    has already seen, so one allreduce of N/M of the values (no mask) reduces a bucket. The first
    step of a bucket is sent dense.

    ``shared_mask=False``: every rank keeps the N largest of M of its own values; the compressed
    buckets (values and a 1-bit-per-element mask) are allgathered and every rank decodes and sums
    all of them. Each rank then receives (P - 1) compressed buckets, where a dense ring allreduce
    moves 2 (P - 1) / P dense buckets: with values as wide as the dense gradients, the allgather
    loses to dense once P > 2 M / N (4 ranks at 2:4); with float16 values against float32
    gradients, once P > 2 M * 32 / (N * 16 + M) (7 ranks at 2:4). Prefer the shared mask beyond.

    `error_feedback` (default on) adds what a step did not deliver to the next step's bucket.
    `schedule`: as ``Compression.nm`` (a list of ``(step, (n, m))``, a StepSchedule, an
    AdaptiveSchedule or "adaptive"); steps count per bucket. Residuals, masks and schedule
    positions are kept per bucket (:func:`~fusionring.ddp.state.bucket_key`) and saved by
    ``state_dict()`` and by pickling (``torch.save(state)``).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, n: int = 2,
                 m: int = 4, values: Union[torch.dtype, str] = torch.float16,
                 shared_mask: bool = True, error_feedback: bool = True,
                 schedule: Union[None, str, Sequence, StepSchedule, AdaptiveSchedule] = None
                 ) -> None:
        super().__init__(process_group)
        self.compressor = NMCompressor(n, m, values, shared_mask, error_feedback,
                                       _schedule_from_description(schedule))
        # An adaptive schedule moves on statistics summed over the group (_agree_on_level).
        self.compressor.adapt_locally = False

    @property
    def shared_mask(self) -> bool:
        return self.compressor.shared_mask

    def config(self) -> Dict[str, Any]:
        return self.compressor.state_dict()["config"]

    def codec_state(self) -> Dict[str, Any]:
        state = self.compressor.state_dict()
        del state["config"]
        return state

    def load_codec_state(self, state: Dict[str, Any]) -> None:
        self.compressor.load_state_dict(dict(state, config=self.config()))

    def keys(self):
        return list(self.codec_state()["tensors"])

    def residual_store(self):
        compressor = self.compressor
        return (compressor.memory.residuals, compressor._lock) if compressor.error_feedback else None

    def forget(self, keys) -> None:
        # In place: the step's other buckets may be decoding on gloo's threads right now.
        self.compressor.forget(keys)

    def __repr__(self) -> str:
        return f"NMState({self.compressor.name})"


def _agree_on_level(compressor: NMCompressor, ctx, group: dist.ProcessGroup,
                    future: torch.futures.Future, device: torch.device) -> torch.futures.Future:
    """With an adaptive schedule, sum the bucket's squared residual and input over the group
    (one allreduce of two doubles beside the bucket's) and move the schedule on the sums when
    both are done, so that every rank compresses its next step at the same level."""
    if ctx.squares is None:
        return future
    sums = torch.tensor(ctx.squares, dtype=torch.float64, device=device)
    both = torch.futures.collect_all(
        [future, dist.all_reduce(sums, group=group, async_op=True).get_future()])

    def observed(fut: torch.futures.Future):
        reduced, _ = fut.value()
        held, total = sums.tolist()
        compressor.observe(ctx, held, total)
        return reduced.value()

    return both.then(observed)


def nm_hook(state: NMState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """N:M-compress `bucket`, reduce it over ``state``'s group and return the decoded average."""
    HookState.check_hook(state, "nm_hook", NMState)
    state.agree("nm_hook", bucket)
    group = state.group()
    size = group.size()
    buffer = bucket.buffer()
    key = state.key(bucket)
    compressor = state.compressor
    # The bucket is scratch space: its decoded average replaces it.
    payload, ctx = compressor.compress(buffer, name=key, scratch=True)
    state.end_of_step(bucket)

    if compressor.shared_mask:
        # Summable values: one allreduce of N/M of the bucket, averaged in float32 afterwards.
        # float16 values are first divided by the power of two at or above the group's size
        # (exact, where torch's fp16_compress_hook divides by the size), so that their sum
        # cannot overflow where each value fits; the rest of the average follows in float32.
        shift = 1 << (size - 1).bit_length() if payload.dtype == torch.float16 else 1
        if shift > 1:
            payload.div_(shift)
        future = _agree_on_level(
            compressor, ctx, group,
            dist.all_reduce(payload, group=group, async_op=True).get_future(), buffer.device)

        def decode_shared(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            reduced = (value[0] if isinstance(value, list) else value).to(torch.float32)
            if shift == 1:
                reduced.div_(size)
            elif shift != size:
                reduced.mul_(shift / size)
            return compressor.decompress(reduced, ctx, out=buffer)

        return future.then(decode_shared)

    # Per-rank masks: one allgather of every rank's mask words and values, as bytes (the words
    # first, so both stay aligned).
    kept, mask = payload
    mask_bytes = mask.numel() * mask.element_size()
    packed = torch.cat([mask.reshape(-1).view(torch.uint8), kept.reshape(-1).view(torch.uint8)])
    gathered = [torch.empty_like(packed) for _ in range(size)]
    future = _agree_on_level(
        compressor, ctx, group,
        dist.all_gather(gathered, packed, group=group, async_op=True).get_future(), buffer.device)

    def add(part: torch.Tensor, total: torch.Tensor) -> None:
        scatter(part[mask_bytes:].view(kept.dtype), part[:mask_bytes].view(torch.int64),
                ctx.count, out=total, accumulate=True, nm=ctx.nm)

    def decode_gathered(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        return mean_into_bucket(buffer, gathered, add, ctx.count, kept.device)

    return future.then(decode_gathered)


# Each further method lives in a file of its own (see the module docstring).
from .cluster import ClusterState, cluster_hook  # noqa: E402
from .layer_selection import LayerSelectionState, layer_selection_hook  # noqa: E402
