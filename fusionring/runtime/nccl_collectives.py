"""The collectives other than allreduce for CUDA tensors, on their GPU over NCCL: broadcast,
allgather, alltoall, reducescatter and Adasum, one request at a time, with the semantics of the MPI
ones (runtime/collectives.py) and the transport of runtime/nccl.py.

Data that only moves (broadcast, allgather, alltoall) travels as bytes, so any dtype does.
Uneven parts (allgather's first dimensions, alltoall's splits) are point-to-point
``ncclSend``/``ncclRecv`` pairs in one group call; a rank's own part is a device copy.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import torch

from ..dtypes import flat_bytes
from .adasum_tree import adasum_allreduce
from .nccl import NcclTransport, ready_event
from .requests import Request


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return flat_bytes(tensor)


def _for_caller(shape, like: torch.Tensor) -> torch.Tensor:
    """A result the caller receives, allocated on the device's current stream (not the NCCL
    stream): once the caller frees it, torch's caching allocator hands its memory to work
    ordered on that stream. The NCCL stream's writes are finished before the caller sees it."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


class NcclCollectives:
    """broadcast, allgather, alltoall and reducescatter of CUDA tensors for a runtime (`rt`:
    its transport, rank, size, stats and MPI communicator for alltoall's split counts)."""

    def __init__(self, rt) -> None:
        self._rt = rt

    def by_kind(self) -> Dict[str, Callable[[List[Request]], None]]:
        """Each request kind's collective on the GPU."""
        return {"allgather": self.allgather, "broadcast": self.broadcast,
                "alltoall": self.alltoall, "reducescatter": self.reducescatter,
                "adasum": self.adasum}

    def _run(self, request: Request, work: Callable[[NcclTransport], Any],
             allocated: bool = True) -> Any:
        """`work` on the transport's stream after the request's producer; returns its result."""
        transport = self._rt.nccl()
        event, request.ready_event = request.ready_event, None
        # Results just allocated on the current stream, whose earlier work may still use that
        # memory: the NCCL stream waits for that too.
        ready = [event, ready_event(request.tensor) if allocated else None]
        return transport.on_stream(request.tensor.device, ready, lambda: work(transport),
                                   describe=lambda: repr(request.name))

    def broadcast(self, requests: List[Request]) -> None:
        request = requests[0]
        self._run(request, lambda t: t.broadcast_bytes(_bytes(request.output), request.root))
        if self._rt.rank == request.root:  # counted as on the CPU path: once, at the root
            self._rt.stats.bytes_sent += request.nbytes

    def allgather(self, requests: List[Request]) -> None:
        request = requests[0]
        tensor = request.tensor
        dims = request.ready_info.first_dims
        rest = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(rest)
        rank, size = self._rt.rank, self._rt.size

        output = _for_caller((sum(dims),) + rest, tensor)

        def work(t: NcclTransport) -> None:
            out_bytes, mine = _bytes(output), _bytes(tensor)
            starts = [sum(dims[:r]) * row_bytes for r in range(size)]
            out_bytes[starts[rank]:starts[rank] + mine.numel()].copy_(mine)
            t.exchange({p: mine for p in range(size) if p != rank},
                       {p: out_bytes[starts[p]:starts[p] + dims[p] * row_bytes]
                        for p in range(size) if p != rank})

        self._run(request, work)
        request.output = output
        self._rt.stats.bytes_sent += request.nbytes * (size - 1)

    def alltoall(self, requests: List[Request]) -> None:
        """Rows of dim 0 to each rank as this rank's splits say; the split counts are swapped
        on MPI first (host integers), then the rows move on the GPU."""
        request = requests[0]
        tensor = request.tensor
        rank, size = self._rt.rank, self._rt.size
        sent_rows = [int(n) for n in request.payload["splits"]]
        received_rows = [int(n) for n in self._rt._data_comm.alltoall(sent_rows)]
        rest = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(rest)

        output = _for_caller((sum(received_rows),) + rest, tensor)

        def work(t: NcclTransport) -> None:
            src, dst = _bytes(tensor), _bytes(output)
            send_at = [sum(sent_rows[:p]) * row_bytes for p in range(size)]
            recv_at = [sum(received_rows[:p]) * row_bytes for p in range(size)]
            dst[recv_at[rank]:recv_at[rank] + received_rows[rank] * row_bytes].copy_(
                src[send_at[rank]:send_at[rank] + sent_rows[rank] * row_bytes])
            t.exchange({p: src[send_at[p]:send_at[p] + sent_rows[p] * row_bytes]
                        for p in range(size) if p != rank},
                       {p: dst[recv_at[p]:recv_at[p] + received_rows[p] * row_bytes]
                        for p in range(size) if p != rank})

        self._run(request, work)
        request.output = output
        request.payload["received_splits"] = received_rows
        self._rt.stats.bytes_sent += (sum(sent_rows) - sent_rows[rank]) * row_bytes

    def reducescatter(self, requests: List[Request]) -> None:
        """Reduce over all ranks; this rank keeps its block of dim 0 (Horovod's blocks: dim 0
        // size rows each, the first dim 0 % size ranks one more). NCCL's reduce-scatter takes
        equal blocks, so each block is padded to the largest; scale factors are applied in
        the tensor's dtype, as Horovod does."""
        request = requests[0]
        tensor = request.tensor
        size, rank = self._rt.size, self._rt.rank
        base, extra = divmod(tensor.shape[0], size)
        rows = [base + (1 if r < extra else 0) for r in range(size)]
        widest = max(rows)
        rest = tuple(tensor.shape[1:])

        received = _for_caller((widest,) + rest, tensor)

        def work(t: NcclTransport) -> None:
            padded = torch.zeros((widest * size,) + rest, dtype=tensor.dtype,
                                 device=tensor.device)
            at = 0
            for r, n in enumerate(rows):
                padded[r * widest:r * widest + n].copy_(tensor[at:at + n])
                at += n
            if request.prescale != 1.0:
                padded.mul_(request.prescale)
            t.reduce_scatter(padded, received, request.core_op)
            if request.postscale != 1.0:
                received[:rows[rank]].mul_(request.postscale)

        self._run(request, work)
        request.output = received[:rows[rank]]
        self._rt.stats.bytes_sent += request.nbytes * (size - 1) // max(size, 1)

    def adasum(self, requests: List[Request]) -> None:
        """Adasum of one tensor in place (runtime/adasum_tree.py), each level's halves and
        dot products swapped with ncclSend/ncclRecv."""
        request = requests[0]
        rank, size = self._rt.rank, self._rt.size

        def work(t: NcclTransport) -> int:
            return adasum_allreduce(
                request.output.view(-1), rank, size,
                lambda send, recv, partner: t.exchange({partner: send}, {partner: recv}),
                request.prescale, request.postscale)

        # The output is the caller's tensor or a copy made on its stream before the request's
        # ready event: nothing new to wait for.
        self._rt.stats.bytes_sent += self._run(request, work, allocated=False)
        self._rt.stats.allreduce_tensors += 1
