"""The online half of balanced fusion: response list -> to-fuse batches + not-yet list.

Once per cycle the runtime's control loop hands :meth:`FusionScheduler.schedule` the response list:
the tensors that are ready on every rank this cycle, in the same order everywhere. Tensors that
belong to a plan group wait in the not-yet list until their whole group is present; then the group
becomes one fused batch, in plan order. Tensors outside every plan group are fused Horovod-style by a
byte threshold. The scheduler is pure policy: it never touches tensor bytes and never calls MPI, and
the same inputs give the same batches on every rank. See ``docs/plan.md``.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import (Any, Callable, Dict, Hashable, Iterable, Iterator, List, Mapping, Optional,
                    Protocol, Sequence, Tuple, Union, runtime_checkable)

# Batch kinds, in the words the timeline and the benchmarks use.
PLAN = "plan"            # a complete plan group
PARTIAL = "partial"      # an incomplete plan group released by flush or by max_hold_cycles
THRESHOLD = "threshold"  # two or more tensors outside the plan, packed up to the byte threshold
SINGLE = "single"        # one tensor outside the plan, reduced on its own


@runtime_checkable
class EntryLike(Protocol):
    """What the scheduler reads from a response-list entry; the runtime may pass its own objects."""

    name: str
    nbytes: int
    fusion_key: Hashable


@dataclasses.dataclass(frozen=True)
class Entry:
    """One ready tensor in the response list.

    ``fusion_key`` holds everything that must agree for tensors to share a buffer (dtype, op,
    scale factors, compression); ``payload`` is the runtime's own, carried along untouched."""

    name: str
    nbytes: int
    fusion_key: Hashable = None
    payload: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class FusedBatch:
    """Entries to fuse into one buffer and reduce together, and why they were put together."""

    entries: List[Any]
    kind: str
    group_id: Optional[int] = None  # the plan group, for PLAN and PARTIAL batches

    @property
    def nbytes(self) -> int:
        """Bytes of the fused buffer (sum over entries)."""
        return sum(int(e.nbytes) for e in self.entries)

    @property
    def names(self) -> List[str]:
        """Entry names, in fusion order."""
        return [e.name for e in self.entries]

    @property
    def fusion_key(self) -> Hashable:
        """The key all entries share."""
        return self.entries[0].fusion_key

    def __iter__(self) -> Iterator[Any]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> Any:
        return self.entries[i]


class SchedulerStats:
    """Running counts of what the scheduler produced: batches, their sizes, how long tensors waited.

    Memory stays bounded: sizes are kept as a running mean/variance (Welford) plus the most recent
    ``keep_recent`` batch sizes; waits as a histogram of held cycles."""

    def __init__(self, keep_recent: int = 4096):
        self._keep_recent = keep_recent
        self.clear()

    def clear(self) -> None:
        """Forget everything counted so far."""
        self.cycles = 0
        self.batches = 0
        self.entries = 0
        self.total_bytes = 0
        self.batches_by_kind: collections.Counter = collections.Counter()
        self.held_cycles: collections.Counter = collections.Counter()  # cycles waited -> tensors
        self.min_batch_bytes: Optional[int] = None
        self.max_batch_bytes: Optional[int] = None
        self.recent_batch_bytes: collections.deque = collections.deque(maxlen=self._keep_recent)
        self._mean = 0.0
        self._m2 = 0.0

    def record_batch(self, nbytes: int, n_entries: int, kind: str) -> None:
        """Count one batch of ``nbytes`` bytes made of ``n_entries`` tensors."""
        self.batches += 1
        self.entries += n_entries
        self.total_bytes += nbytes
        self.batches_by_kind[kind] += 1
        self.recent_batch_bytes.append(nbytes)
        if self.min_batch_bytes is None or nbytes < self.min_batch_bytes:
            self.min_batch_bytes = nbytes
        if self.max_batch_bytes is None or nbytes > self.max_batch_bytes:
            self.max_batch_bytes = nbytes
        delta = nbytes - self._mean
        self._mean += delta / self.batches
        self._m2 += delta * (nbytes - self._mean)

    @property
    def mean_batch_bytes(self) -> float:
        """Mean fused-buffer size in bytes (0 before any batch)."""
        return self._mean if self.batches else 0.0

    @property
    def std_batch_bytes(self) -> float:
        """Population standard deviation of fused-buffer sizes."""
        return math.sqrt(self._m2 / self.batches) if self.batches else 0.0

    @property
    def coefficient_of_variation(self) -> float:
        """Standard deviation over mean of fused-buffer sizes: 0 means perfectly even buffers."""
        return self.std_batch_bytes / self._mean if self.batches and self._mean > 0 else 0.0

    @property
    def mean_held_cycles(self) -> float:
        """Mean number of cycles a tensor waited in the not-yet list before its batch went out."""
        n = sum(self.held_cycles.values())
        return sum(c * k for c, k in self.held_cycles.items()) / n if n else 0.0

    def as_dict(self) -> Dict[str, Any]:
        """All counters as plain JSON-ready values."""
        return {
            "cycles": self.cycles,
            "batches": self.batches,
            "entries": self.entries,
            "total_bytes": self.total_bytes,
            "batches_by_kind": dict(sorted(self.batches_by_kind.items())),
            "mean_batch_bytes": self.mean_batch_bytes,
            "std_batch_bytes": self.std_batch_bytes,
            "coefficient_of_variation": self.coefficient_of_variation,
            "min_batch_bytes": self.min_batch_bytes,
            "max_batch_bytes": self.max_batch_bytes,
            "held_cycles": {str(c): k for c, k in sorted(self.held_cycles.items())},
            "mean_held_cycles": self.mean_held_cycles,
        }


# Parameter name -> submitted tensor name, or None for a parameter that is never submitted.
NameOfParam = Union[Callable[[str], Optional[str]], Mapping[str, str]]


def tensor_groups_from_plan(plan: Any, name_of_param: NameOfParam, *,
                            include_unused: bool = False) -> List[List[str]]:
    """Translate a plan's parameter-name groups into groups of submitted tensor names.

    ``name_of_param`` maps a parameter name to the tensor name the runtime submits (e.g.
    ``lambda p: "allreduce." + p``), or to None for a parameter that is never submitted (it is left
    out, so its group can still complete). The plan's group of parameters that got no gradient while
    profiling is left out unless ``include_unused``; such tensors then go by threshold. Empty groups
    are dropped."""
    lookup = name_of_param.get if isinstance(name_of_param, Mapping) else name_of_param
    out = []
    for i, group in enumerate(plan.groups):
        if not include_unused and plan.is_unused_group(i):
            continue
        names = [lookup(p) for p in group]
        names = [n for n in names if n is not None]
        if names:
            out.append(names)
    return out


class FusionScheduler:
    """Splits each cycle's response list into fused batches and a not-yet list.

    ``groups`` are lists of tensor names (as submitted) that must be fused together, from a plan
    (:func:`tensor_groups_from_plan`); None means no plan. ``threshold_bytes`` bounds Horovod-style
    fusion of tensors outside every group (None: the ``FUSIONRING_FUSION_THRESHOLD`` setting; 0
    disables it). ``max_hold_cycles``, if set, releases an incomplete group once its oldest tensor
    has waited that many cycles, so a parameter that skips a step cannot stall the others; None
    waits for the group or for ``flush``. A cycle is one :meth:`schedule` call."""

    def __init__(self, groups: Optional[Sequence[Sequence[str]]] = None,
                 threshold_bytes: Optional[int] = None, *, max_hold_cycles: Optional[int] = None):
        if threshold_bytes is None:
            from fusionring.config import settings
            threshold_bytes = settings().fusion_threshold_bytes
        if threshold_bytes < 0:
            raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
        if max_hold_cycles is not None and max_hold_cycles < 1:
            raise ValueError(f"max_hold_cycles must be >= 1 or None, got {max_hold_cycles}")
        self.threshold_bytes = int(threshold_bytes)
        self.max_hold_cycles = max_hold_cycles
        self._groups: Tuple[Tuple[str, ...], ...] = tuple(tuple(g) for g in (groups or ()) if g)
        self._group_of: Dict[str, int] = {}
        for gid, group in enumerate(self._groups):
            for name in group:
                if name in self._group_of:
                    raise ValueError(f"tensor {name!r} is in plan groups {self._group_of[name]} "
                                     f"and {gid}; groups must not overlap")
                self._group_of[name] = gid
        # Not-yet list: name -> (entry, cycle it arrived), in arrival order.
        self._held: Dict[str, Tuple[Any, int]] = {}
        self._held_per_group: collections.Counter = collections.Counter()
        self._cycle = 0
        self.stats = SchedulerStats()

    @classmethod
    def from_plan(cls, plan: Any, name_of_param: NameOfParam, threshold_bytes: Optional[int] = None, *,
                  max_hold_cycles: Optional[int] = None) -> "FusionScheduler":
        """A scheduler for a :class:`fusionring.plan.Plan` (None: threshold fusion only)."""
        groups = None if plan is None else tensor_groups_from_plan(plan, name_of_param)
        return cls(groups, threshold_bytes, max_hold_cycles=max_hold_cycles)

    @property
    def groups(self) -> Tuple[Tuple[str, ...], ...]:
        """The plan groups, as tensor names."""
        return self._groups

    @property
    def pending(self) -> Tuple[str, ...]:
        """Names in the not-yet list, in the order they arrived."""
        return tuple(self._held)

    def reset(self) -> List[Any]:
        """Drop the not-yet list and return its entries, in arrival order (so the caller can fail
        them, e.g. after an error aborted the step); statistics are kept."""
        dropped = [entry for entry, _ in self._held.values()]
        self._held.clear()
        self._held_per_group.clear()
        return dropped

    def schedule(self, response: Iterable[Any], flush: bool = False) -> List[FusedBatch]:
        """Batches to fuse and reduce this cycle; tensors of incomplete groups stay pending.

        Order: plan batches by group id (entries in plan order, one batch per fusion key), then
        threshold and single batches in response order. ``flush`` releases every pending tensor and
        must be decided identically on every rank, as must the response list itself."""
        cycle = self._cycle
        self._cycle += 1
        self.stats.cycles += 1
        outside: List[Any] = []
        touched = set()
        seen_now = set()
        for entry in response:
            name = entry.name
            if name in seen_now or name in self._held:
                raise ValueError(f"tensor {name!r} is already waiting to be reduced; a name may be "
                                 f"submitted again only after its reduction finished")
            seen_now.add(name)
            gid = self._group_of.get(name)
            if gid is None:
                outside.append(entry)
            else:
                self._held[name] = (entry, cycle)
                self._held_per_group[gid] += 1
                touched.add(gid)

        batches: List[FusedBatch] = []
        # Only groups that gained a tensor can have completed; flush and staleness look at all.
        look_at_all = flush or self.max_hold_cycles is not None
        candidates = sorted(g for g, c in self._held_per_group.items() if c) if look_at_all \
            else sorted(touched)
        for gid in candidates:
            members = self._groups[gid]
            complete = self._held_per_group[gid] == len(members)
            if not complete and not flush and not self._stale(members, cycle):
                continue
            released = [self._held.pop(n) for n in members if n in self._held]
            del self._held_per_group[gid]
            for entry, arrived in released:
                self.stats.held_cycles[cycle - arrived] += 1
            kind = PLAN if complete else PARTIAL
            for same_key in _split_by_key([e for e, _ in released]):
                batches.append(FusedBatch(same_key, kind, gid))

        for entry in outside:
            self.stats.held_cycles[0] += 1
        batches.extend(self._threshold_batches(outside))
        for batch in batches:
            self.stats.record_batch(batch.nbytes, len(batch), batch.kind)
        return batches

    def one_batch(self, nbytes: int, n_entries: int) -> bool:
        """Whether ``n_entries`` unheld tensors of one fusion key, ``nbytes`` in all, make a
        single threshold (or single-tensor) batch."""
        return n_entries == 1 or 0 < nbytes <= self.threshold_bytes

    def count_batch(self, nbytes: int, n_entries: int) -> None:
        """Count a batch reduced without :meth:`schedule` (its negotiation round carried it)
        as schedule() would have: one cycle, its tensors held none, one batch."""
        self._cycle += 1
        self.stats.cycles += 1
        self.stats.held_cycles[0] += n_entries
        self.stats.record_batch(nbytes, n_entries, THRESHOLD if n_entries > 1 else SINGLE)

    def _stale(self, members: Sequence[str], cycle: int) -> bool:
        if self.max_hold_cycles is None:
            return False
        oldest = min(self._held[n][1] for n in members if n in self._held)
        return cycle - oldest >= self.max_hold_cycles

    def _threshold_batches(self, entries: Sequence[Any]) -> List[FusedBatch]:
        # Horovod-style: consecutive entries with one key share a buffer while it stays within the
        # threshold; an entry above the threshold (or any entry, with threshold 0) goes alone.
        batches: List[FusedBatch] = []
        current: List[Any] = []
        current_bytes = 0

        def close() -> None:
            if current:
                batches.append(FusedBatch(list(current), THRESHOLD if len(current) > 1 else SINGLE))
                current.clear()

        for entry in entries:
            nbytes = int(entry.nbytes)
            if self.threshold_bytes == 0 or nbytes > self.threshold_bytes:
                close()
                batches.append(FusedBatch([entry], SINGLE))
                continue
            if current and (entry.fusion_key != current[0].fusion_key
                            or current_bytes + nbytes > self.threshold_bytes):
                close()
            if not current:
                current_bytes = 0
            current.append(entry)
            current_bytes += nbytes
        close()
        return batches


def _split_by_key(entries: Sequence[Any]) -> List[List[Any]]:
    """Entries grouped by fusion key, keys in order of first appearance, entry order kept."""
    by_key: Dict[Hashable, List[Any]] = {}
    for e in entries:
        by_key.setdefault(e.fusion_key, []).append(e)
    return list(by_key.values())
