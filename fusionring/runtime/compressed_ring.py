"""The compressed ring on tensors: the sum of a float32 buffer over the ranks that moves only
a codec's payloads, for buffers on a GPU (NCCL between hops).

The same algorithm as the core's ring (csrc/compressed_ring.cc), so a codec gives the same
bits on either:
  * reduce-scatter: each hop decodes the incoming chunk and adds it to this rank's own
    values, encodes the sum again and sends that on; what encoding loses stays here;
  * the owner of each reduced chunk encodes it once more and the encoded chunks are
    allgathered; every rank decodes the same bytes, so the result is identical everywhere.
Chunks are split among ranks as the core splits them (whole granules, the first
`granules % size` chunks one granule longer). Each chunk travels as one payload: the
transport pipelines its bytes itself.

The transport is one function, `exchange(send, recv)`: send the uint8 tensor `send` to the
right neighbour and receive `recv` from the left one, both at once. On a GPU that is an
``ncclSend``/``ncclRecv`` pair in one group call on the transport's stream, so the codec's
kernels and the hops follow each other in stream order, with no host synchronization.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..reduction import Codec

Exchange = Callable[[torch.Tensor, torch.Tensor], None]


def compressed_allreduce(buf: torch.Tensor, codec: Codec, exchange: Exchange, rank: int,
                         size: int, residual: Optional[torch.Tensor] = None,
                         prescale: float = 1.0, postscale: float = 1.0) -> Dict[str, int]:
    """Sum contiguous float32 `buf` over `size` ranks in place; returns the bytes this rank
    sent and received.

    With `residual` (float32, as many elements) error feedback is on: the input becomes
    prescale * buf + residual, and `residual` is overwritten with everything this rank's
    encodings lost.
    """
    stats = {"bytes_sent": 0, "bytes_received": 0}
    flat = buf.view(-1)
    res = residual.view(-1) if residual is not None else None
    if prescale != 1.0:
        flat.mul_(prescale)
    if res is not None:
        flat.add_(res)
    count = flat.numel()
    if count == 0:
        return stats
    granule = max(1, int(codec.granule))
    granules = -(-count // granule)
    base, extra = divmod(granules, size)

    def bounds(c: int):
        first = c * base + min(c, extra)
        length = base + (1 if c < extra else 0)
        return min(first * granule, count), min((first + length) * granule, count)

    chunks = [bounds(c) for c in range(size)]
    sizes = [codec.payload_bytes(e - b) for b, e in chunks]
    slot_bytes = -(-max(sizes) // 8) * 8
    # size + 1 slots: the reduce-scatter's outgoing images and two incoming ones; afterwards
    # slot c holds chunk c for the allgather. Slots begin at multiples of 8 bytes, so a codec
    # may view a payload's words as int64.
    storage = torch.empty((size + 1) * slot_bytes, dtype=torch.uint8, device=flat.device)

    def image(slot: int, c: int) -> torch.Tensor:
        return storage[slot * slot_bytes:slot * slot_bytes + sizes[c]]

    def encode(payload: torch.Tensor, c: int) -> None:
        b, e = chunks[c]
        codec.encode(flat[b:e], b, payload, res[b:e] if res is not None else None)

    def decode(payload: torch.Tensor, c: int, add: bool) -> None:
        b, e = chunks[c]
        (codec.decode_add if add else codec.decode)(payload, flat[b:e])

    def hop(send: torch.Tensor, recv: torch.Tensor) -> None:
        exchange(send, recv)
        stats["bytes_sent"] += send.numel()
        stats["bytes_received"] += recv.numel()

    if size == 1:
        encode(image(0, 0), 0)
        decode(image(0, 0), 0, add=False)
    else:
        # Reduce-scatter: after size - 1 hops this rank holds the sum of chunk rank + 1.
        outgoing = image(0, rank)
        encode(outgoing, rank)
        for s in range(size - 1):
            c = (rank - s - 1) % size
            incoming = image(size - 1 + s % 2, c)
            hop(outgoing, incoming)
            decode(incoming, c, add=True)
            if s + 1 < size - 1:
                outgoing = image(s + 1, c)
                encode(outgoing, c)
        # Allgather of encoded chunks: the owner encodes its sum once and decodes its own
        # image, so every rank's result comes from the same bytes.
        own = (rank + 1) % size
        outgoing = image(own, own)
        encode(outgoing, own)
        decode(outgoing, own, add=False)
        for s in range(size - 1):
            c = (rank - s) % size
            incoming = image(c, c)
            hop(outgoing, incoming)
            decode(incoming, c, add=False)
            outgoing = incoming
    if postscale != 1.0:
        flat.mul_(postscale)
    return stats
