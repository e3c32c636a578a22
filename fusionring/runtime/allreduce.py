"""How a fused allreduce batch is carried: an ordered list of ops, each saying whether it
takes the batch (`enabled`) and carrying it (`execute`); the first that is enabled runs.

Every op decides from the batch's kind, sizes, counts and the settings, never from
addresses, so every rank picks the same collective.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch

from .. import _C
from ..dtypes import DTYPE_CODES, contiguous_view
from ..negotiation import is_cacheable
from ..reduction import ReductionContext
from ..scheduler import THRESHOLD
from ..timeline import recording_phases
from .requests import Request


def lane(requests: List[Request]) -> str:
    """The timeline row of a collective: its tensor's name, or its batch's."""
    first = requests[0]
    return first.name if len(requests) == 1 else f"group of {len(requests)} from {first.name}"


class AllreduceOp:
    """One way to carry a batch; `rt` is the runtime it runs in (its core, window, settings,
    stats and timeline)."""

    def __init__(self, rt) -> None:
        self._rt = rt

    def enabled(self, requests: List[Request], kind: str) -> bool:
        raise NotImplementedError

    def execute(self, requests: List[Request], kind: str) -> None:
        raise NotImplementedError

    @staticmethod
    def _layout(requests: List[Request]):
        """(bytes of the batch, its outputs as one tensor when they lie back to back or None)."""
        total = sum(r.nbytes for r in requests)
        contiguous = None if len(requests) == 1 else contiguous_view([r.output for r in requests])
        return total, contiguous

    def _count(self, requests: List[Request], nbytes: int, sent: Optional[int]) -> None:
        size = self._rt.size
        if not isinstance(sent, int):  # what a ring of `nbytes` sends from each rank
            sent = nbytes * 2 * (size - 1) // max(size, 1)
        self._rt.stats.count_batch(len(requests), nbytes, sent)


class NcclAllreduce(AllreduceOp):
    """CUDA tensors on their GPU (runtime/nccl.py): a batch is packed, reduced and unpacked
    on the transport's stream, or reduced where it lies when it is one tensor or lies back
    to back. The runtime's transport is created by its first such batch."""

    def enabled(self, requests: List[Request], kind: str) -> bool:
        # Only a request for the GPU path holds a CUDA tensor: others were staged to host.
        # A compressor that reduces inside the runtime runs its own ring (CompressedAllreduce).
        return requests[0].tensor.is_cuda and requests[0].communicator is None

    def execute(self, requests: List[Request], kind: str) -> None:
        rt = self._rt
        first = requests[0]
        t0 = time.perf_counter()
        total, contiguous = self._layout(requests)
        device_time = rt.nccl().allreduce(
            [r.output for r in requests], [r.ready_event for r in requests], first.core_op,
            first.prescale, first.postscale, contiguous,
            describe=lambda: repr(lane(requests)))
        for request in requests:
            request.ready_event = None  # the tensor may be freed on its own stream now
        if len(requests) > 1 and contiguous is None:
            rt.stats.packed_bytes += total
        self._count(requests, total, None)
        timeline = rt._timeline
        if timeline is not None:
            timeline.span(lane(requests), "reduce", t0, time.perf_counter(),
                          {"tensors": len(requests), "bytes": total, "transport": "nccl",
                           **device_time})


class CompressedAllreduce(AllreduceOp):
    """A compressor that reduces inside the runtime (`Request.communicator`): it reads and
    writes each output where it lies, so there is no pack or unpack."""

    def enabled(self, requests: List[Request], kind: str) -> bool:
        return requests[0].communicator is not None

    def execute(self, requests: List[Request], kind: str) -> None:
        rt = self._rt
        first = requests[0]
        name = lane(requests)
        total = sum(r.nbytes for r in requests)
        buffer = (first.output if len(requests) == 1
                  else contiguous_view([r.output for r in requests]))
        context = self.context(requests, buffer)
        t1 = time.perf_counter()
        # Its encode and decode overlap the ring, so they get a lane of their own.
        with recording_phases(rt._timeline, f"{name} (compression)",
                              {"tensors": len(requests), "bytes": total}):
            if first.tensor.is_cuda:  # on the NCCL stream, after the tensors' producers
                sent = rt.nccl().on_stream(first.output.device,
                                          [r.ready_event for r in requests],
                                          lambda: first.communicator(context),
                                          describe=lambda: repr(name))
                for request in requests:
                    request.ready_event = None
            else:
                sent = first.communicator(context)
        t2 = time.perf_counter()
        self._count(requests, total, sent)
        timeline = rt._timeline
        if timeline is not None:
            timeline.span(name, "reduce", t1, t2, {"tensors": len(requests), "bytes": total})

    def context(self, requests: List[Request],
                buffer: Optional[torch.Tensor]) -> ReductionContext:
        """What the compressor needs for this batch, and nothing of the runtime."""
        rt = self._rt
        first = requests[0]
        if buffer is None:
            outputs = [r.output.reshape(-1) for r in requests]
        else:
            outputs = list(torch.split(buffer.reshape(-1), [r.output.numel() for r in requests]))
        names = [r.name for r in requests]
        device_ring = device_allreduce = allgather = None
        if first.tensor.is_cuda:
            device_ring, device_allreduce = rt.nccl().ring, rt.nccl().sum_in_place
        else:
            allgather = rt._mpi.gather_parts
        return ReductionContext(
            core=rt._core, outputs=outputs, names=names,
            keys=[n if is_cacheable(n) else None for n in names], buffer=buffer,
            core_op=first.core_op, prescale=first.prescale, postscale=first.postscale,
            ring_segment_bytes=rt.config.ring_segment_bytes,
            small_message_bytes=rt.config.small_message_bytes, size=rt.size,
            device_ring=device_ring, device_allreduce=device_allreduce, allgather=allgather)


class SharedMemoryAllreduce(AllreduceOp):
    """The shared-memory window (csrc/shm_allreduce.cc), when every rank shares this host:
    the window's copy in and out replaces the pack and unpack."""

    _round_started = 0.0  # when the last with_round began (count_round traces from it)

    def enabled(self, requests: List[Request], kind: str) -> bool:
        rt = self._rt
        if (rt._shm is None or requests[0].communicator is not None or requests[0].tensor.is_cuda
                or sum(r.nbytes for r in requests) <= rt.config.small_message_bytes):
            return False
        # With two ranks the ring moves fewer bytes than the window's copy in and out
        # (measured on one buffer: 1 MiB in 0.23 against 0.44 ms, 16 MiB in 3.5 against
        # 4.0 ms), so "auto" uses the window there only where it replaces the fusion
        # buffer's pack and unpack: a threshold batch of several tensors (a plan group lies
        # in one buffer already). "on" sends every batch through the window.
        if (rt.size == 2 and rt.config.shared_memory == "auto"
                and (len(requests) == 1 or kind != THRESHOLD)):
            return False
        return True

    def execute(self, requests: List[Request], kind: str) -> None:
        rt = self._rt
        first = requests[0]
        t0 = time.perf_counter()
        total = sum(r.nbytes for r in requests)
        rt._shm.allreduce([r.output.data_ptr() for r in requests],
                          [r.nbytes for r in requests], DTYPE_CODES[first.output.dtype],
                          first.core_op, first.prescale, first.postscale,
                          rt.config.stall_shutdown_s or 0.0)
        self._count(requests, total, None)
        timeline = rt._timeline
        if timeline is not None:
            timeline.span(lane(requests), "reduce", t0, time.perf_counter(),
                          {"tensors": len(requests), "bytes": total,
                           "transport": "shared memory"})


    def with_round(self, requests: List[Request], address: int, count: int) -> bool:
        """The negotiation round's AND of `count` words at `address` and, when every rank
        offered identical words, the in-place reduction of `requests` in the same wait."""
        rt = self._rt
        first = requests[0]
        self._round_started = time.perf_counter()
        return rt._shm.band_then_allreduce(
            address, count, [r.output.data_ptr() for r in requests], [r.nbytes for r in requests],
            DTYPE_CODES[first.output.dtype], first.core_op, first.prescale, first.postscale,
            0.0)  # as the round's AND: a late peer is waited for (stall checks report it)

    def count_round(self, requests: List[Request]) -> None:
        """Count (and trace) a batch reduced by with_round."""
        total = sum(r.nbytes for r in requests)
        self._count(requests, total, None)
        timeline = self._rt._timeline
        if timeline is not None:
            timeline.span(lane(requests), "reduce", self._round_started, time.perf_counter(),
                          {"tensors": len(requests), "bytes": total,
                           "transport": "shared memory, with the negotiation round"})


class RingAllreduce(AllreduceOp):
    """The core's ring (or recursive doubling for small buffers) over MPI, on one buffer:
    the tensor itself, a group that lies back to back, or the fusion buffer (pack, ring,
    unpack)."""

    def __init__(self, rt) -> None:
        super().__init__(rt)
        self._fusion_buffers: Dict[torch.dtype, torch.Tensor] = {}

    def enabled(self, requests: List[Request], kind: str) -> bool:
        return True

    def _fusion_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = self._fusion_buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 1024), dtype=dtype)
            self._fusion_buffers[dtype] = buffer
        return buffer[:numel]

    def execute(self, requests: List[Request], kind: str) -> None:
        rt = self._rt
        first = requests[0]
        t0 = time.perf_counter()
        total, contiguous = self._layout(requests)
        if len(requests) == 1:
            buffer = first.output
        elif contiguous is not None:  # already laid out as one buffer (a plan's group)
            buffer = contiguous
        else:
            buffer = self._fusion_buffer(first.output.dtype,
                                         sum(r.output.numel() for r in requests))
            _C.pack([r.output.data_ptr() for r in requests], [r.nbytes for r in requests],
                    buffer.data_ptr())
            rt.stats.packed_bytes += total
        t1 = time.perf_counter()
        rt._core.allreduce(buffer.data_ptr(), buffer.numel(), DTYPE_CODES[first.output.dtype],
                           first.core_op, first.prescale, first.postscale,
                           rt.config.ring_segment_bytes, rt.config.small_message_bytes)
        t2 = time.perf_counter()
        copies = len(requests) > 1 and contiguous is None
        if copies:
            _C.unpack(buffer.data_ptr(), [r.output.data_ptr() for r in requests],
                      [r.nbytes for r in requests])
        t3 = time.perf_counter()
        self._count(requests, total, None)
        timeline = rt._timeline
        if timeline is not None:
            args = {"tensors": len(requests), "bytes": total}
            name = lane(requests)
            if copies:
                timeline.span(name, "pack", t0, t1, args)
            timeline.span(name, "reduce", t1, t2, args)
            if copies:
                timeline.span(name, "unpack", t2, t3, args)


class AllreduceOps:
    """The ops in the order they are asked (as Horovod's OperationManager): NCCL for CUDA
    tensors, a compressor that reduces itself, then the shared-memory window, then the ring,
    which takes any batch of host tensors."""

    def __init__(self, ops: Sequence[AllreduceOp]) -> None:
        self.ops = list(ops)

    def choose(self, requests: List[Request], kind: str) -> AllreduceOp:
        for op in self.ops:
            if op.enabled(requests, kind):
                return op
        raise RuntimeError(f"no allreduce op takes the batch of '{requests[0].name}'")

    def execute(self, requests: List[Request], kind: str) -> None:
        self.choose(requests, kind).execute(requests, kind)
