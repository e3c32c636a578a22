"""The collectives other than a fused allreduce, one request at a time, on MPI (mpi4py on the
runtime's data communicator) or, for Adasum, on the core."""
from __future__ import annotations

import itertools
import math
from typing import Callable, Dict, List

import torch

from .. import _C
from ..dtypes import DTYPE_CODES, byte_view, flat_bytes
from .requests import Request


class MpiCollectives:
    """allgather, alltoall, reducescatter, broadcast, barrier and Adasum for a runtime (`rt`:
    its data communicator, core, rank, size and stats)."""

    def __init__(self, rt) -> None:
        self._rt = rt

    def by_kind(self) -> Dict[str, Callable[[List[Request]], None]]:
        """Each request kind's collective (allreduce goes through the fused path, Adasum
        included only where it is asked for by op)."""
        return {"allgather": self.allgather, "broadcast": self.broadcast,
                "barrier": self.barrier, "alltoall": self.alltoall,
                "reducescatter": self.reducescatter}

    def allgather(self, requests: List[Request]) -> None:
        request = requests[0]
        request.output = self._gather(request.tensor, request.ready_info.first_dims)
        # what a ring sends: every rank's rows but this rank's own, which it only keeps
        own = request.tensor.numel() * request.tensor.element_size()
        self._rt.stats.bytes_sent += request.output.numel() * request.output.element_size() - own

    def allgather_fused(self, requests: List[Request]) -> None:
        """Several allgathers of host tensors in one Allgatherv: each rank sends its tensors'
        bytes back to back, and each output is cut from every rank's block. Thousands of
        small allgathers (a grouped allgather, objects) cost one collective, as Horovod fuses
        them, instead of one each."""
        if len(requests) == 1:
            return self.allgather(requests)
        MPI = self._rt._MPI
        size = self._rt.size
        rows = [r.ready_info.first_dims for r in requests]            # [tensor][rank]
        row_bytes = [r.tensor.element_size() * math.prod(r.tensor.shape[1:]) for r in requests]
        counts = [sum(d[rank] * b for d, b in zip(rows, row_bytes)) for rank in range(size)]
        send = torch.cat([flat_bytes(r.tensor) for r in requests])
        received = torch.empty(sum(counts), dtype=torch.uint8)
        self._rt._data_comm.Allgatherv([send.numpy(), MPI.BYTE],
                                       [received.numpy(), counts, _displacements(counts),
                                        MPI.BYTE])
        # received: rank by rank, each rank's tensors in order; an output: its rows from
        # every rank in rank order.
        parts = torch.split(received, [d[rank] * b for rank in range(size)
                                       for d, b in zip(rows, row_bytes)])
        n = len(requests)
        for i, (request, d) in enumerate(zip(requests, rows)):
            output = torch.empty((sum(d),) + tuple(request.tensor.shape[1:]),
                                 dtype=request.tensor.dtype)
            torch.cat(parts[i::n], out=flat_bytes(output))
            request.output = output
        self._rt.stats.bytes_sent += sum(counts) - counts[self._rt.rank]

    def _gather(self, tensor: torch.Tensor, dims: List[int]) -> torch.Tensor:
        """Every rank's rows of `tensor` (rank r has dims[r] of them), concatenated."""
        MPI = self._rt._MPI
        rest = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(rest)
        output = torch.empty((sum(dims),) + rest, dtype=tensor.dtype)
        counts = [d * row_bytes for d in dims]
        self._rt._data_comm.Allgatherv([byte_view(tensor), MPI.BYTE],
                                       [byte_view(output), counts, _displacements(counts),
                                        MPI.BYTE])
        return output

    def gather_parts(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's `tensor` (a CPU tensor whose dim 0 may differ by rank), in rank
        order: what a compressor whose payload cannot be summed (indices, say) exchanges in
        its communicate(). Runs on the background thread, inside the batch's reduction."""
        tensor = tensor.contiguous() if tensor.dim() else tensor.reshape(1)
        dims = [int(d) for d in self._rt._data_comm.allgather(tensor.shape[0])]
        return list(torch.split(self._gather(tensor, dims), dims))

    def alltoall(self, requests: List[Request]) -> None:
        """Send rows of dim 0 to each rank as this rank's splits say; receive the peers'.

        Ranks first swap their split counts, so each learns how many rows every peer sends
        it; `payload["received_splits"]` keeps them for the caller.
        """
        request = requests[0]
        MPI = self._rt._MPI
        tensor = request.tensor
        sent_rows = [int(n) for n in request.payload["splits"]]
        received_rows = [int(n) for n in self._rt._data_comm.alltoall(sent_rows)]
        rest = tuple(tensor.shape[1:])
        row_bytes = tensor.element_size() * math.prod(rest)
        output = torch.empty((sum(received_rows),) + rest, dtype=tensor.dtype)
        send_counts = [n * row_bytes for n in sent_rows]
        recv_counts = [n * row_bytes for n in received_rows]
        self._rt._data_comm.Alltoallv(
            [byte_view(tensor), send_counts, _displacements(send_counts), MPI.BYTE],
            [byte_view(output), recv_counts, _displacements(recv_counts), MPI.BYTE])
        request.output = output
        request.payload["received_splits"] = received_rows
        self._rt.stats.bytes_sent += sum(send_counts) - send_counts[self._rt.rank]

    def reducescatter(self, requests: List[Request]) -> None:
        """Reduce over all ranks; this rank keeps its block of dim 0.

        Blocks follow Horovod: dim 0 // size rows each, and the first dim 0 % size ranks
        one row more. MPI has no float16/bfloat16 type, so those are widened to float32
        here, reduced and scaled there, and rounded back once at the end. A prescaled
        float16/bfloat16 input is rounded to its own dtype before the sum, as every
        rank's scaled contribution is in Horovod (it scales in the tensor's dtype).
        """
        request = requests[0]
        MPI = self._rt._MPI
        tensor = request.tensor
        base, extra = divmod(tensor.shape[0], self._rt.size)
        rows = [base + (1 if r < extra else 0) for r in range(self._rt.size)]
        rest = tuple(tensor.shape[1:])
        row_numel = math.prod(rest)
        output = torch.empty((rows[self._rt.rank],) + rest, dtype=tensor.dtype)
        wide = tensor.dtype in (torch.float16, torch.bfloat16)
        send = tensor.float() if wide else tensor
        received = torch.empty(output.shape, dtype=torch.float32) if wide else output
        code = DTYPE_CODES[send.dtype]
        if request.prescale != 1.0:
            if send is tensor:  # `tensor` may be the caller's memory: scale a copy
                send = tensor.clone()
            _C.scale(send.data_ptr(), send.numel(), code, request.prescale)
            if wide:
                send = send.to(tensor.dtype).float()
        # request.core_op holds the core's op code (fusionring.ops.core_reduction).
        if request.core_op in (1, 2) and send.is_floating_point():
            # MPI's MIN and MAX compare with `<`: a NaN is lost or kept depending on the rank
            # that holds it, and -0 ties +0. The core's allreduce follows allreduce's rule
            # (NaN wins, -0 below +0); this rank keeps its block of it.
            full = send.clone() if send is tensor else send
            config = self._rt.config
            self._rt._core.allreduce(full.data_ptr(), full.numel(), code, request.core_op,
                                     1.0, 1.0, config.ring_segment_bytes,
                                     config.small_message_bytes)
            start = sum(rows[:self._rt.rank]) * row_numel
            received.reshape(-1).copy_(full.reshape(-1)[start:start + received.numel()])
        else:
            mpi_op = {0: MPI.SUM, 1: MPI.MIN, 2: MPI.MAX, 3: MPI.PROD}[request.core_op]
            self._rt._data_comm.Reduce_scatter(send.reshape(-1).numpy(),
                                               received.reshape(-1).numpy(),
                                               [n * row_numel for n in rows], op=mpi_op)
        _C.scale(received.data_ptr(), received.numel(), code, request.postscale)
        if wide:
            output.copy_(received)
        request.output = output
        self._rt.stats.bytes_sent += request.nbytes * (self._rt.size - 1) // max(self._rt.size, 1)

    def adasum(self, requests: List[Request]) -> None:
        """Adasum (Maleki et al.) in the core: the tree combination of every rank's vector,
        pairs at distance 1, 2, 4, ... combined as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b,
        moved by vector halving and distance doubling (csrc/adasum.cc)."""
        request = requests[0]
        out = request.output
        self._rt._core.adasum(out.data_ptr(), out.numel(), DTYPE_CODES[out.dtype],
                          request.prescale, request.postscale)
        # Halving, then gathering back: about 2 (P-1)/P of the vector leaves each rank.
        self._rt.stats.bytes_sent += request.nbytes * 2 * (self._rt.size - 1) // max(self._rt.size, 1)
        self._rt.stats.allreduce_tensors += 1

    def broadcast(self, requests: List[Request]) -> None:
        request = requests[0]
        if request.output.numel():
            self._rt._data_comm.Bcast([byte_view(request.output), self._rt._MPI.BYTE], root=request.root)
        if self._rt.rank == request.root:  # the data leaves the root once; MPI's forwarding is its own
            self._rt.stats.bytes_sent += request.nbytes

    def barrier(self, requests: List[Request]) -> None:
        self._rt._data_comm.Barrier()


def _displacements(counts: List[int]) -> List[int]:
    """Where each rank's part starts in a buffer of parts laid end to end."""
    return list(itertools.accumulate([0] + counts[:-1]))
