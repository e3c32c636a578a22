"""What the runtime hands a compressor that reduces inside it: one ReductionContext.

A leaf shared by the runtime (which fills it in) and the compressors (which read it), so
neither imports the other: a compressor learns the batch's tensors, names, op, scales and
ring settings from here, never from the runtime's configuration or negotiation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch


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
