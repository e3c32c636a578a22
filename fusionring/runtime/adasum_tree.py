"""Adasum on tensors: the core's tree (csrc/adasum.cc) for vectors on a GPU, NCCL between
levels.

Vector halving with distance doubling: at distance d = 1, 2, 4, ... a rank keeps half of its
segment, swaps the other half with its partner (rank ^ d), and combines its half of both
vectors as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b, a being the lower rank's side. The
dot products are summed over the 2^(level+1) ranks whose pieces tile the vector (recursive
doubling of three float64 values), so every rank computes the same coefficients without the
host seeing them. The halves are then gathered back, widest distance first. The dot products
and the combination are computed in float64; 16-bit vectors travel as they are and are rounded
through float32, as the core does. Only the order of the dot products' additions differs from
the core's, so results agree with it to a few ulps.

The transport is one function, ``sendrecv(send, recv, partner)``: uint8 tensors swapped with
`partner`, both at once (on a GPU an ``ncclSend``/``ncclRecv`` pair in one group call, in
stream order).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch

SendRecv = Callable[[torch.Tensor, torch.Tensor, int], None]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _coefficient(dot: torch.Tensor, normsq: torch.Tensor) -> torch.Tensor:
    """1 - a.b / 2|a|^2, or 1 when a is zero or the ratio leaves double's range."""
    safe = torch.where(normsq > 0, normsq, torch.ones_like(normsq))
    c = 1.0 - dot / (2.0 * safe)
    return torch.where((normsq > 0) & torch.isfinite(c), c, torch.ones_like(c))


def adasum_allreduce(v: torch.Tensor, rank: int, size: int, sendrecv: SendRecv,
                     prescale: float = 1.0, postscale: float = 1.0) -> int:
    """Combine contiguous 1-D floating-point `v` over `size` ranks (a power of two) in place;
    returns the bytes this rank sent."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, not {size}")
    if prescale != 1.0:
        v.mul_(prescale)
    sent = 0
    if size > 1 and v.numel():
        sent = _tree(v, rank, size, sendrecv)
    if postscale != 1.0:
        v.mul_(postscale)
    return sent


def _tree(v: torch.Tensor, rank: int, size: int, sendrecv: SendRecv) -> int:
    levels = size.bit_length() - 1
    count = v.numel()
    received = torch.empty(count // 2 + 1, dtype=v.dtype, device=v.device)
    kept: List[Tuple[int, int]] = []
    lo, hi = 0, count
    sent = 0
    for d in range(levels):
        dist = 1 << d
        partner = rank ^ dist
        lower = (rank & dist) == 0
        mid = lo + (hi - lo) // 2
        mine = (lo, mid) if lower else (mid, hi)
        give = (mid, hi) if lower else (lo, mid)
        n = mine[1] - mine[0]
        theirs = received[:n]
        sendrecv(_bytes(v[give[0]:give[1]]), _bytes(theirs), partner)
        sent += (give[1] - give[0]) * v.element_size()
        own = v[mine[0]:mine[1]]
        a, b = (own, theirs) if lower else (theirs, own)
        wa, wb = a.double(), b.double()  # exact, as the core's widening through float32
        # a.b, |a|^2, |b|^2 over this rank's piece, then over the ranks that tile the vector
        sums = torch.stack([torch.dot(wa, wb), torch.dot(wa, wa), torch.dot(wb, wb)])
        for k in range(d + 1):
            other = torch.empty_like(sums)
            sendrecv(_bytes(sums), _bytes(other), rank ^ (1 << k))
            sums = sums + other
        ac, bc = _coefficient(sums[0], sums[1]), _coefficient(sums[0], sums[2])
        combined = ac * wa + bc * wb
        own.copy_(combined.float() if v.element_size() == 2 else combined)
        kept.append(mine)
        lo, hi = mine
    # Gather the pieces back, widest distance first: partners hold the two halves of the
    # segment they split at that level.
    for d in range(levels - 1, -1, -1):
        partner = rank ^ (1 << d)
        mine = kept[d]
        parent = kept[d - 1] if d > 0 else (0, count)
        lower = (rank & (1 << d)) == 0
        theirs = (mine[1], parent[1]) if lower else (parent[0], mine[0])
        sendrecv(_bytes(v[mine[0]:mine[1]]), _bytes(v[theirs[0]:theirs[1]]), partner)
        sent += (mine[1] - mine[0]) * v.element_size()
    return sent
