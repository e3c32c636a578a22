"""What the runtime hands a compressor that reduces inside it: one ReductionContext.

A leaf shared by the runtime (which fills it in) and the compressors (which read it), so
neither imports the other: a compressor learns the batch's tensors, names, op, scales and
ring settings from here, never from the runtime's configuration or negotiation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch


class Codec(Protocol):
    """What the compressed ring on tensors (fusionring/runtime/compressed_ring.py) needs from
    a compression method; the twin of csrc/codec.h, for buffers on a GPU.

    Payloads are uint8 tensors on the buffer's device, laid out by the codec; their size is
    a function of the element count alone, so sender and receiver agree without asking.
    """

    granule: int  # chunks begin at multiples of this many elements (an N:M group, say)

    def payload_bytes(self, count: int) -> int:
        """Bytes of the payload of `count` elements, a multiple of 8."""

    def encode(self, x: torch.Tensor, at: int, payload: torch.Tensor,
               residual: Optional[torch.Tensor]) -> None:
        """Encode float32 `x` (which begins at element `at` of the buffer) into `payload`;
        `residual`, when given, receives x - decode(payload)."""

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """out = the decoded values."""

    def decode_add(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """out += the decoded values."""


# ring(buffer, codec, residual, prescale, postscale) -> {"bytes_sent", "bytes_received"}:
# the in-place compressed sum of a float32 buffer over the ranks (error feedback in
# `residual` when given), on the device where the buffer lies.
DeviceRing = Callable[[torch.Tensor, Codec, Optional[torch.Tensor], float, float], Dict[str, int]]


@dataclasses.dataclass
class ReductionContext:
    """One fused batch to reduce in place, identical in shape on every rank."""

    core: Any                         # the core's communicator (fusionring._C.Communicator)
    outputs: List[torch.Tensor]       # each tensor's flat result buffer, reduced in place
    names: List[str]                  # each tensor's name, for messages
    keys: List[Optional[str]]         # each tensor's state key (None: a one-off, auto name)
    buffer: Optional[torch.Tensor]    # the outputs as one tensor when back to back, else None
    core_op: int                      # the core's op code (fusionring.ops.core_reduction)
    prescale: float
    postscale: float
    ring_segment_bytes: int
    small_message_bytes: int
    size: int                         # ranks taking part
    # For a batch of CUDA tensors: the compressed ring on their GPU (NCCL between hops),
    # which a compressor runs with its codec instead of the core's ring (None on the host).
    device_ring: Optional[DeviceRing] = None
    # For a batch of CUDA tensors: the in-place sum of a tensor on their GPU over the ranks
    # (NCCL's allreduce), for payloads that can be summed (None on the host).
    device_allreduce: Optional[Callable[[torch.Tensor], None]] = None
    # For a batch on the host: every rank's CPU tensor (dim 0 may differ by rank), in rank
    # order, for payloads that cannot be summed (indices, say): `allgather(tensor)` -> list.
    allgather: Optional[Callable[[torch.Tensor], List[torch.Tensor]]] = None
