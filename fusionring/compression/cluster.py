"""Cluster-and-hash gradient quantization (SPEC section 3, seed 000).

Per block of gradient values (a tensor, or one segment of the ring): a seeded sample of the
values, 1-D K-means on it (K centres), a score per cluster (density x |centre| x entropy, each
normalised), hash buckets shared among the clusters in proportion to the scores (at least one
each), then one pass that assigns every value to its nearest centre and adds it to one of its
cluster's buckets chosen by a hash of its index. What travels: the bucket means, the buckets
per cluster and the mapping table of cluster ids, ceil(log2 K) bits per value. A receiver
looks up each index's cluster, then its bucket by the same hash, and reads the mean. The
kernels are ``csrc/cluster_quant.*``; the exact rules are written there. Blocks on a GPU use
the same rules in torch operations (``cluster_kernels.py``), so they never visit the host.

Codebooks differ per rank, so payloads are not summable: inside the runtime the C++ core runs
the compressed ring (``csrc/compressed_ring.*``, shared with N:M's per-rank masks): each
reduce-scatter hop decodes, adds and re-encodes, keeping what re-encoding loses as this rank's
residual, and the owners' encoded sums are allgathered. CUDA tensors take the same ring on
tensors (``runtime/compressed_ring.py``, NCCL between hops, ``cluster_codec.py``). Error
feedback (on by default) adds each rank's residual back at the next step, so everything sent
plus all residuals equals the sum of all gradients.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

import numpy as np
import torch

from .. import _C
from ..dtypes import VALUE_CODES, contiguous_view, dtype_name
from ..reduction import ReductionContext
from .base import Compressor, Memory, check_flag, check_floating, register_compressor, working_copy
from . import cluster_kernels
from .cluster_codec import ClusterCodec

__all__ = ["ClusterCompressor", "cluster", "default_buckets", "bits_per_element", "MAX_K",
           "MAX_BUCKETS", "RING_SEGMENT_BYTES"]

MAX_K = 256
MAX_BUCKETS = 65535
# Inside the runtime a block is at least this many dense bytes: K-means on the sample and
# the tables cost the same for any block, so small blocks would pay them too often.
RING_SEGMENT_BYTES = 4 << 20


def default_buckets(k: int) -> int:
    """``buckets=None``: one bucket per cluster (K in all), which is plain K-means quantization.

    Measured on real gradients (docs/benchmarks/cluster-quant.md), more buckets allotted by
    the clusters' scores lowered the error by under 1% -- no more than the same buckets shared
    evenly -- while costing table bytes, so the default is the smallest payload. Pass
    ``buckets=4 * k`` (say) for the scored hash buckets."""
    return k


def _check_int(label: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"Compression.cluster {label} must be an int, not {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"Compression.cluster {label}={value} must be {bound}")
    return value


def _check_values(values: Any) -> torch.dtype:
    if isinstance(values, str):
        values = getattr(torch, values, values)
    if values not in VALUE_CODES:
        raise ValueError(f"Compression.cluster values={values!r} must be torch.float32, "
                         f"torch.float16 or torch.bfloat16")
    return values


def bits_per_element(count: int, k: int = 16, buckets: Optional[int] = None,
                     values: torch.dtype = torch.float32) -> float:
    """Payload bits per value of a block of `count`: ceil(log2 K) for the mapping table plus
    the tables' share (bucket means and per-cluster bucket counts, padded to 8 bytes)."""
    buckets = default_buckets(k) if buckets is None else buckets
    size = torch.empty(0, dtype=_check_values(values)).element_size()
    table = buckets * size + 2 * k
    ids = (count * _C.cluster_id_bits(k) + 7) // 8
    return 8 * ((table + ids + 7) // 8 * 8) / count


@dataclasses.dataclass
class _Context:
    key: Optional[str]
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    count: int


class ClusterCompressor(Compressor):
    """Cluster-and-hash quantization as a Horovod compressor that also reduces in the runtime.

    ``Compression.cluster(k=16, sample=4096, buckets=None, values=torch.float32,
    error_feedback=True, seed=0)``. With DistributedOptimizer and hvd.allreduce it runs on the
    runtime's background thread (``in_runtime``), keyed by tensor name. On its own:
    ``payload, ctx = c.compress(t, name=...)`` (a uint8 tensor, on the tensor's GPU for a
    CUDA tensor) then ``c.decompress(payload, ctx)``.
    """

    summable = False      # per-rank codebooks
    in_runtime = True
    stateful = True       # residuals and the sampling stream's position
    named = True          # residuals kept per tensor name

    def __init__(self, k: int = 16, sample: int = 4096, buckets: Optional[int] = None,
                 values: torch.dtype = torch.float32, error_feedback: bool = True,
                 seed: int = 0) -> None:
        self.k = _check_int("k", k, 2, MAX_K)
        self.sample = _check_int("sample", sample, self.k)
        self.buckets = (default_buckets(self.k) if buckets is None
                        else _check_int("buckets", buckets, self.k, MAX_BUCKETS))
        self.values = _check_values(values)
        self.error_feedback = check_flag("Compression.cluster", "error_feedback", error_feedback)
        self.seed = _check_int("seed", seed, 0, 2 ** 64 - 1)
        self.position = 0  # reductions so far: the sampling stream's step
        self.memory = Memory()
        self._lock = threading.RLock()
        self.stats = {"reductions": 0, "dense_bytes": 0, "payload_bytes": 0, "wire_bytes": 0}

    @property
    def name(self) -> str:
        """Agreed across ranks (negotiation): differing configurations fail loudly."""
        return (f"cluster(k={self.k},sample={self.sample},buckets={self.buckets},"
                f"{dtype_name(self.values)},ef={int(self.error_feedback)},seed={self.seed})")

    def __repr__(self) -> str:
        return f"Compression.{self.name}"

    def _args(self) -> tuple:
        return self.k, self.sample, self.buckets, VALUE_CODES[self.values]

    def payload_bytes(self, count: int) -> int:
        """Bytes of the payload of a block of `count` values."""
        return _C.cluster_payload_bytes(count, *self._args())

    # ------------------------------------------------------------------ Horovod shape
    def compress(self, tensor: torch.Tensor, name: Optional[str] = None, scratch: bool = False):
        """Encode `tensor` as one block -> (uint8 payload, ctx). The residual is kept per
        `name`; without one per shape and dtype, so name distinct tensors. `scratch=True`: the
        caller lets a float32 contiguous `tensor` be overwritten (a DDP bucket that the decoded
        result replaces), which saves copying it."""
        check_floating("Compression.cluster", tensor, name)
        key = name if name is not None else f"{tuple(tensor.shape)}:{tensor.dtype}"
        with self._lock:
            # A CUDA tensor is encoded on its GPU (the torch kernels), its payload left there.
            device = tensor.device if tensor.is_cuda else torch.device("cpu")
            x = working_copy(tensor, device, scratch)
            count = x.numel()
            residual = self.memory.compensate_for_new(key, x) if self.error_feedback else None
            payload = torch.empty(self.payload_bytes(count), dtype=torch.uint8, device=device)
            stream = _C.cluster_stream(self.seed, self.position, 0)
            if x.is_cuda:
                cluster_kernels.encode(x, self.k, self.sample, self.buckets, self.values,
                                       stream, payload, residual)
            else:
                _C.cluster_encode(x.data_ptr(), count, *self._args(), stream,
                                  payload.data_ptr(),
                                  residual.data_ptr() if residual is not None else 0)
            if residual is not None:
                self.memory.update(key, residual)
            self.position += 1
        return payload, _Context(key, tensor.shape, tensor.dtype, tensor.device, count)

    def decompress(self, payload, ctx):
        """Rebuild the dense tensor; ctx None (the in-runtime path) returns it unchanged."""
        if ctx is None:
            return payload
        out = torch.empty(ctx.count, device=payload.device if payload.is_cuda else "cpu")
        self._decode(payload, out, add=False)
        return out.reshape(ctx.shape).to(device=ctx.device, dtype=ctx.dtype)

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Decode `payload` (of ``out.numel()`` values) and add it into `out`, a contiguous
        float32 tensor (on a GPU, decoded there)."""
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("Compression.cluster decode_add needs a contiguous float32 tensor")
        self._decode(payload, out, add=True)

    def _decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool) -> None:
        count = out.numel()
        payload = payload.detach().to(out.device).contiguous()
        if payload.dtype != torch.uint8 or payload.numel() != self.payload_bytes(count):
            raise ValueError(f"Compression.cluster payload must be {self.payload_bytes(count)}"
                             f" uint8 bytes for {count} values, got {payload.numel()} "
                             f"{payload.dtype}")
        if out.is_cuda:
            cluster_kernels.decode(payload, self.k, self.buckets, self.values, out, add)
        else:
            _C.cluster_decode(payload.data_ptr(), count, *self._args(), out.data_ptr(), add)

    def forget(self, keys) -> None:
        """Drop the residuals kept under `keys`."""
        with self._lock:
            for key in keys:
                self.memory.residuals.pop(key, None)

    # ------------------------------------------------------------------ runtime path
    def reduces_on_gpu(self, tensor: torch.Tensor) -> bool:
        """Floating-point CUDA tensors reduce on their GPU: the compressed ring with NCCL
        between hops and the torch kernels of cluster_kernels.py in stream order."""
        return tensor.is_floating_point()

    def communicate(self, job: ReductionContext) -> int:
        """Reduce the batch's outputs in place on the compressed ring; returns bytes sent."""
        if job.core_op != 0:
            raise ValueError(f"Compression.cluster reduces with Sum or Average only (tensor "
                             f"'{job.names[0]}')")
        outputs = job.outputs
        on_gpu = bool(outputs) and outputs[0].is_cuda and job.device_ring is not None
        views = [out if out.dtype == torch.float32 and (on_gpu or not out.is_cuda)
                 else out.float() if on_gpu else out.float().cpu() for out in outputs]
        keys = job.keys
        sizes = [x.numel() for x in views]
        with self._lock:
            sub = contiguous_view(views)  # one compressed ring over all of them
            if sub is None:
                sub = torch.cat(views)
            offsets = np.cumsum([0] + sizes[:-1]).tolist()
            residual = None
            if self.error_feedback:
                residual = torch.zeros(sub.numel(), device=sub.device)
                for key, offset, numel in zip(keys, offsets, sizes):
                    stored = self.memory.fitting(key, numel)
                    if stored is not None:
                        residual[offset:offset + numel].copy_(stored.reshape(-1))
            segment = max(job.ring_segment_bytes, RING_SEGMENT_BYTES)
            if on_gpu:  # the core's ring and blocks, NCCL between hops
                codec = ClusterCodec(self.k, self.sample, self.buckets, self.values, self.seed,
                                     self.position, segment // 4)
                out = job.device_ring(sub, codec, residual, job.prescale, job.postscale)
            else:
                out = job.core.cluster_allreduce(
                    sub.data_ptr(), sub.numel(), *self._args(), self.seed, self.position,
                    residual.data_ptr() if residual is not None else 0, job.prescale,
                    job.postscale, segment)
            if sub.data_ptr() != views[0].data_ptr():  # reduced in a copy
                for x, offset, numel in zip(views, offsets, sizes):
                    x.copy_(sub[offset:offset + numel])
            if residual is not None:
                for key, offset, numel in zip(keys, offsets, sizes):
                    if key is not None:
                        self.memory.update_from(key, residual[offset:offset + numel])
            self.position += 1
            self.stats["reductions"] += 1
            self.stats["dense_bytes"] += sub.numel() * 4
            self.stats["payload_bytes"] += self._ring_payload_bytes(sub.numel(), segment)
            self.stats["wire_bytes"] += out["bytes_sent"]
        for target, view in zip(outputs, views):
            if view is not target:  # a 16-bit or device gradient was reduced in float32
                target.copy_(view)
        return out["bytes_sent"]

    def _ring_payload_bytes(self, count: int, segment_bytes: int) -> int:
        step = max(1, segment_bytes // 4)
        full, tail = divmod(count, step)
        return full * self.payload_bytes(step) + (self.payload_bytes(tail) if tail else 0)

    # ------------------------------------------------------------------ checkpoints
    def _config(self) -> dict:
        return {"k": self.k, "sample": self.sample, "buckets": self.buckets,
                "values": dtype_name(self.values), "error_feedback": self.error_feedback,
                "seed": self.seed}

    def state_dict(self) -> dict:
        """Residuals and the sampling stream's position, for an exact resume."""
        with self._lock:
            return {"config": self._config(), "position": self.position,
                    "residuals": self.memory.state_dict(), "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict saved; ValueError when it came from another configuration."""
        saved = state.get("config")
        if saved != self._config():
            raise ValueError(f"Compression.cluster state was saved with configuration {saved}, "
                             f"but this compressor is {self._config()}")
        with self._lock:
            self.position = int(state["position"])
            self.memory.load_state_dict(state["residuals"])
            self.stats = dict(state.get("stats", self.stats))


def cluster(k: int = 16, sample: int = 4096, buckets: Optional[int] = None,
            values: torch.dtype = torch.float32, error_feedback: bool = True,
            seed: int = 0) -> ClusterCompressor:
    """``Compression.cluster(...)``: a new cluster quantizer (one per optimizer: it keeps
    state)."""
    return ClusterCompressor(k, sample, buckets, values, error_feedback, seed)


register_compressor("cluster", cluster)
