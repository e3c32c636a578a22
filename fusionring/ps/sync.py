"""Synchronization policies of the parameter server: which pushes to aggregate, and whom to answer.

Each policy sees only the order in which pushes (and epoch ends) arrive, so everything the server decides is
deterministic given that order and can be tested without MPI. A push is ``(worker, iteration)``; the policy answers
with a ``Decision``: the gradients to apply now (workers and weights, in list order) and the workers to reply to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

SYNC_MODES = ("bsp", "asp", "ssp", "adaptive")
DEFAULT_SLACK = 2.0  # adaptive: aggregate once more than this many further pushes arrived (the 3rd), even if the
                     # sync group is incomplete


@dataclass
class Decision:
    """What the server does after one event: each entry of ``updates`` is one optimizer step on the weighted sum
    of the listed workers' gradients ((worker, weight) pairs), applied in order; then reply to ``reply``.
    ``average``: the updates are plain averages, so a parameter that some of the listed workers have no gradient
    for is the average over those that have one (the weights name all of them)."""
    updates: List[List[Tuple[int, float]]] = field(default_factory=list)
    reply: List[int] = field(default_factory=list)
    average: bool = False


class BSP:
    """Aggregate one gradient from every active worker (plain average), update, reply to all."""

    def __init__(self, num_workers: int):
        self.active = set(range(num_workers))
        self.pending: List[int] = []

    def push(self, worker: int, iteration: int) -> Decision:
        self.pending.append(worker)
        return self._maybe_flush()

    def leave(self, worker: int) -> Decision:
        self.active.discard(worker)
        return self._maybe_flush()

    def _maybe_flush(self) -> Decision:
        if self.pending and self.active <= set(self.pending):
            w = 1.0 / len(self.pending)
            # Summed in worker order, not arrival order: the same bits whoever came first.
            d = Decision([[(k, w) for k in sorted(self.pending)]], list(self.pending), average=True)
            self.pending = []
            return d
        return Decision()

    def end_epoch(self, worker: int, epoch: int) -> Decision:
        return Decision()

    def state(self) -> dict:
        """The bookkeeping a resumed job needs (gradients still in flight are not part of it)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore ``state()``'s bookkeeping."""


class ASP:
    """Apply each gradient on arrival and reply to its worker."""

    def __init__(self, num_workers: int):
        self.active = set(range(num_workers))

    def push(self, worker: int, iteration: int) -> Decision:
        return Decision([[(worker, 1.0)]], [worker])

    def leave(self, worker: int) -> Decision:
        self.active.discard(worker)
        return Decision()

    def end_epoch(self, worker: int, epoch: int) -> Decision:
        return Decision()

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class SSP:
    """As ASP, but a worker more than ``staleness`` iterations ahead of the slowest active worker waits."""

    def __init__(self, num_workers: int, staleness: int):
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {staleness!r}")
        self.staleness = staleness
        self.num_workers = num_workers
        self.iters: Dict[int, int] = {k: 0 for k in range(num_workers)}
        self.held: List[int] = []

    def _release(self) -> List[int]:
        slowest = min(self.iters.values()) if self.iters else 0
        out = [k for k in self.held if self.iters[k] - slowest <= self.staleness]
        self.held = [k for k in self.held if k not in out]
        return out

    def push(self, worker: int, iteration: int) -> Decision:
        self.iters[worker] = self.iters[worker] + 1
        self.held.append(worker)
        return Decision([[(worker, 1.0)]], self._release())

    def leave(self, worker: int) -> Decision:
        self.iters.pop(worker, None)
        self.held = [k for k in self.held if k != worker]
        return Decision([], self._release())

    def end_epoch(self, worker: int, epoch: int) -> Decision:
        return Decision()

    def state(self) -> dict:
        return {"iters": dict(self.iters)}

    def load_state(self, state: dict) -> None:
        saved = {int(k): int(v) for k, v in state["iters"].items()}
        # A worker missing from the saved counts had shut down before the save; every worker of
        # the resumed job takes part again, the missing ones from the slowest saved count.
        base = min(saved.values()) if saved else 0
        self.iters = {k: saved.get(k, base) for k in range(self.num_workers)}
        self.held = []


class Adaptive:
    """The seed's adaptive scheme: ASP start, then per-epoch relaxed BSP for the top-s fastest workers.

    At each epoch end, once every active worker has completed an epoch: s = max - min epochs completed; if s > 1
    the s workers with the most epochs (ties: lower rank first; at most all but the slowest) form the sync
    group, the rest stay asynchronous.
    Sync-group gradients go to an aggregation list; from its first entry on, a slack counter counts every push the
    server receives; the list is aggregated when it holds one gradient from every sync-group worker or the counter
    exceeds ``slack``. Weights: worker k's gradient counts ``it_k / max(it_j for j in list)`` with ``it_k`` the
    worker's iteration count at its push: the most advanced gradient counts as an asynchronous one does, stale,
    less advanced ones less.
    """

    def __init__(self, num_workers: int, slack: Optional[float] = None):
        if slack is None:
            slack = DEFAULT_SLACK
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 0:
            raise ValueError(f"slack must be a non-negative number or None, got {slack!r}")
        self.slack = float(slack)
        self.active = set(range(num_workers))
        self.epochs: Dict[int, int] = {k: 0 for k in range(num_workers)}
        self.group: List[int] = []
        self.s = 0
        self.list: List[Tuple[int, int]] = []
        self.counter = 0
        self.updates = 0
        self.changes: List[dict] = []

    def _flush(self) -> Decision:
        newest = float(max(max(it, 1) for _, it in self.list))
        d = Decision([[(k, max(it, 1) / newest) for k, it in self.list]], [k for k, _ in self.list])
        self.list, self.counter = [], 0
        return d

    def push(self, worker: int, iteration: int) -> Decision:
        if self.list:
            self.counter += 1
        if worker not in self.group:
            d = Decision([[(worker, 1.0)]], [worker])
            self.updates += 1
            if self.list and self.counter > self.slack:
                f = self._flush()
                self.updates += 1
                d = Decision(d.updates + f.updates, d.reply + f.reply)
            return d
        self.list.append((worker, iteration))
        if {k for k, _ in self.list} >= set(self.group) or self.counter > self.slack:
            self.updates += 1
            return self._flush()
        return Decision()

    def leave(self, worker: int) -> Decision:
        self.active.discard(worker)
        self.epochs.pop(worker, None)
        if worker in self.group:
            self.group = [k for k in self.group if k != worker]
            self.changes.append({"update": self.updates, "s": self.s, "sync_group": list(self.group),
                                 "async": sorted(set(self.epochs) - set(self.group)), "left": worker})
            if self.list and {k for k, _ in self.list} >= set(self.group):
                self.updates += 1
                return self._flush()
        return Decision()

    def unblock(self) -> Decision:
        """Aggregate the list now. Each of several servers runs the rule on its own arrival order, so
        around a group change one server's list can wait for a worker another server holds, while no
        further push comes to count towards ``slack``: the server calls this after a quiet spell."""
        if not self.list:
            return Decision()
        self.updates += 1
        return self._flush()

    def end_epoch(self, worker: int, epoch: int) -> Decision:
        self.epochs[worker] = epoch
        if not self.epochs or min(self.epochs.values()) < 1:
            return Decision()
        s = max(self.epochs.values()) - min(self.epochs.values())
        order = sorted(self.epochs, key=lambda k: (-self.epochs[k], k))
        # At most all workers but the slowest: the gap is the straggler's doing, so a gap as
        # large as the number of workers still leaves the slowest asynchronous.
        group = sorted(order[:min(s, len(order) - 1)]) if s > 1 else []
        self.s = s
        if group != self.group:
            self.changes.append({"update": self.updates, "s": s, "sync_group": group,
                                 "async": sorted(set(self.epochs) - set(group))})
            self.group = group
            if self.list and (not group or {k for k, _ in self.list} >= set(group)):
                self.updates += 1
                return self._flush()
        return Decision()


    def state(self) -> dict:
        # the aggregation list holds gradients in flight: a resumed job starts with an empty list
        return {"epochs": dict(self.epochs), "group": list(self.group), "updates": self.updates,
                "changes": [dict(c) for c in self.changes]}

    def load_state(self, state: dict) -> None:
        self.epochs = {int(k): int(v) for k, v in state["epochs"].items()}
        self.group = list(state["group"])
        self.updates = int(state["updates"])
        self.changes = [dict(c) for c in state["changes"]]
        self.list, self.counter = [], 0


def make_policy(sync: str, num_workers: int, staleness: int = 3, slack: Optional[float] = None):
    """Build the policy object for ``sync``; ValueError naming the bad argument."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    if sync == "bsp":
        return BSP(num_workers)
    if sync == "asp":
        return ASP(num_workers)
    if sync == "ssp":
        return SSP(num_workers, staleness)
    return Adaptive(num_workers, slack)
