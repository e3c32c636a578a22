"""Which submitted tensors are ready on every rank: the per-cycle agreement.

Steady state costs one small allreduce per cycle: every known tensor name has a cache
id, and ranks AND a bit vector of the ids they have pending. A name that is new, or
whose spec changed, makes that cycle a full exchange instead: rank 0 gathers every
rank's pending specs, validates them against each other (the precise cross-rank error
comes from here), assigns cache ids and broadcasts the outcome.

A rank that called ``join()`` counts as having submitted every allreduce and barrier the
others submit (it takes part with zeros); an allgather or a broadcast while some rank has
joined fails on the ranks that submitted it, as in Horovod, and leaves them free to join in
turn. Ranks learn each cycle who has joined, and the join completes once every rank has
joined and nothing is pending anywhere.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

# Flag bits, ORed across ranks (sent inverted through a bitwise-AND allreduce).
FLAG_UNCACHED = 1
FLAG_SHUTDOWN = 4
FLAG_STALL_CHECK = 8
# Header words before the joined-ranks words and the bit vectors: the ORed flags, then
# two words ANDed as they are (flush; nothing pending).
_HEADER_WORDS = 3
# Kinds a joined rank can take part in from the cache alone. Any other kind, with a joined
# rank, goes through a full exchange, where rank 0 turns it into an error.
_JOINABLE_FROM_CACHE = ("allreduce", "barrier")


AUTO_NAME_MARK = ".noname."


def is_cacheable(name: str) -> bool:
    """Auto-generated names are used once; caching them would grow the bit vector forever.

    A pure function of the name, so every rank keeps the same cache.
    """
    return AUTO_NAME_MARK not in name


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What every rank must agree on before an operation's data moves."""

    kind: str                 # allreduce, allgather, alltoall, reducescatter, broadcast, barrier
    dtype: str
    shape: Tuple[int, ...]
    op: str = ""              # reduction op name, allreduce and reducescatter only
    root: int = -1            # broadcast only
    prescale: float = 1.0
    postscale: float = 1.0
    compression: str = ""     # a compressor that runs inside the runtime
    detail: str = ""          # anything else that must agree (e.g. a fusion plan's digest)
    device: str = ""          # "cuda": on the GPU over NCCL; "": through host memory
    group: int = 0            # tensors in its grouped operation (grouped_allreduce...); 0: alone
    # Why this rank could not take part (bad input, raised to its own caller): the others'
    # matching operation then fails naming it instead of waiting for it.
    refused: str = ""

    def comparable(self) -> tuple:
        """The fields that must be equal across ranks (allgather and alltoall may differ
        in dim 0; how alltoall splits it is exchanged when it runs)."""
        shape = (self.shape[1:] if self.kind in ("allgather", "alltoall") and self.shape
                 else self.shape)
        ndim = len(self.shape)
        return (self.kind, self.dtype, ndim, shape, self.op, self.root, self.prescale,
                self.postscale, self.compression, self.detail, self.device, self.group)


@dataclasses.dataclass
class Ready:
    """A tensor ready on every rank; `first_dims` holds each rank's dim 0 for allgather.

    `spec` is the agreed spec: a joined rank, which submitted nothing, builds its part
    of the operation from it."""

    name: str
    first_dims: Optional[List[int]] = None
    spec: Optional[TensorSpec] = None


@dataclasses.dataclass
class Outcome:
    """What one cycle decided, identical on every rank."""

    ready: List[Ready] = dataclasses.field(default_factory=list)
    errors: Dict[str, str] = dataclasses.field(default_factory=dict)
    flush: bool = False
    shutdown_ranks: List[int] = dataclasses.field(default_factory=list)
    shutdown_reason: Optional[str] = None  # a leaving rank's own account (a removed set)
    abort: Optional[str] = None
    stall_warning: Optional[str] = None
    joined_ranks: List[int] = dataclasses.field(default_factory=list)
    join_done: bool = False   # every rank has joined and nothing is pending anywhere
    all_idle: bool = False    # no rank had anything pending or held when the cycle began
    settled: bool = False     # everything pending anywhere was ready everywhere this cycle
    last_joined: int = -1     # with join_done: the rank that joined last
    reduced: bool = False     # `ready` was reduced within the round itself (cycle's `reduce`)


def display_name(name: str) -> str:
    """"allreduce.layer1.weight" -> "allreduce 'layer1.weight'" for messages."""
    kind, _, rest = name.partition(".")
    if name == "barrier":  # a barrier's name is its kind
        return name
    return f"{kind} '{rest}'" if rest else f"'{name}'"


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _global(rank: int, global_ranks: Optional[Sequence[int]]) -> int:
    """A process set's rank as the global rank users know it by (messages only)."""
    return global_ranks[rank] if global_ranks and 0 <= rank < len(global_ranks) else rank


def _field_values(spec: TensorSpec,
                  global_ranks: Optional[Sequence[int]] = None) -> List[Tuple[str, object]]:
    shape = list(spec.shape)
    if spec.kind in ("allgather", "alltoall"):
        shape_field = ("shape (all but the first dimension)", [*shape[1:]] if shape else [])
    else:
        shape_field = ("shape", shape)
    return [("operation", spec.kind), ("number of tensors in the group", spec.group or 1),
            ("dtype", spec.dtype), ("rank of the tensor", len(shape)),
            shape_field, ("op", spec.op), ("root rank", _global(spec.root, global_ranks)),
            ("prescale factor", spec.prescale), ("postscale factor", spec.postscale),
            ("compression", spec.compression or "none"), ("configuration", spec.detail),
            ("reduced on", "GPU (NCCL)" if spec.device else "host memory")]


def mismatch_message(name: str, specs: Sequence[TensorSpec],
                     ranks: Optional[Sequence[int]] = None,
                     global_ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """Describe how ranks disagree on `name`, or None when they agree.

    The text names the operation, the tensor, the field and which ranks sent what, e.g.
    "allreduce 'layer1.weight': rank 0 sent shape [17, 17], rank 2 sent [18, 18]". In a
    process set (`global_ranks`: its ranks in the world), ranks and root ranks are global.
    """
    first = specs[0]
    if all(s.comparable() == first.comparable() for s in specs):
        return None
    name = _bare(name, first)
    per_rank = [_field_values(s, global_ranks) for s in specs]
    ranks = list(ranks) if ranks is not None else list(range(len(specs)))
    ranks = [_global(r, global_ranks) for r in ranks]
    for i, (field, _) in enumerate(per_rank[0]):
        by_value: Dict[str, List[int]] = {}
        for rank, values in zip(ranks, per_rank):
            by_value.setdefault(repr(values[i][1]) if not isinstance(values[i][1], str)
                                else values[i][1], []).append(rank)
        if len(by_value) > 1:
            parts = [f"{_ranks_text(ranks)} sent {value}" for value, ranks in by_value.items()]
            parts[0] = parts[0].replace(" sent ", f" sent {field} ", 1)
            return f"{first.kind} '{name}': " + ", ".join(parts)
    return f"{first.kind} '{name}': ranks disagree on the operation's parameters"


@dataclasses.dataclass
class _Report:
    """One rank's pending operations, in submission order: (name, spec, age in seconds)."""

    rank: int
    pending: List[Tuple[str, TensorSpec, float]]
    joined: bool = False


def coordinate(reports: Sequence[_Report], stall_warning_s: Optional[float],
               stall_shutdown_s: Optional[float],
               global_ranks: Optional[Sequence[int]] = None) -> Outcome:
    """Rank 0's half of a full exchange: validate, pick what is ready, spot stalls. Messages
    name a process set's ranks by their global ranks (`global_ranks`)."""
    size = len(reports)

    def shown(ranks: Sequence[int]) -> List[int]:
        return [_global(r, global_ranks) for r in ranks]

    joined = {report.rank for report in reports if report.joined}
    by_name: Dict[str, Dict[int, Tuple[TensorSpec, float]]] = {}
    for report in reports:
        for name, spec, age in report.pending:
            by_name.setdefault(name, {})[report.rank] = (spec, age)
    outcome = Outcome()
    order = [name for name, _, _ in reports[0].pending]
    first = set(order)  # once: thousands of names may be pending in one exchange
    order += sorted(n for n in by_name if n not in first)
    stalled: List[Tuple[str, List[int], float]] = []
    for name in order:
        entries = by_name[name]
        missing = [r for r in range(size) if r not in entries]
        if joined:
            # What a joined rank cannot take part in fails now, on the ranks that submitted
            # it, rather than after the rest submit too: their names may never match (an
            # unnamed operation's counter differs on a rank that skipped one while joined).
            error = _join_conflict(name, next(iter(entries.values()))[0], sorted(joined),
                                   global_ranks)
            if error is not None:
                outcome.errors[name] = error
                continue
        if any(r not in joined for r in missing):
            oldest = max(age for _, age in entries.values())
            stalled.append((name, [r for r in missing if r not in joined], oldest))
            continue
        present = sorted(entries)
        specs = [entries[r][0] for r in present]
        refusals = _refusals(name, specs, present, global_ranks)
        if refusals is not None:
            outcome.errors[name] = refusals
            continue
        error = (mismatch_message(name, specs, present, global_ranks) if len(present) > 1
                 else None)
        if error is not None:
            outcome.errors[name] = error
            continue
        first_dims = ([_first_dim(entries[r][0]) for r in range(size)]
                      if specs[0].kind == "allgather" else None)
        outcome.ready.append(Ready(name, first_dims, specs[0]))
    # Inside a process set, which set: its rank 1 and the job's rank 1 are different ranks.
    where = f" in the process set of {_ranks_text(global_ranks)}" if global_ranks else ""
    if stalled and stall_warning_s is not None:
        late = [(n, m, a) for n, m, a in stalled if a >= stall_warning_s]
        if late:
            lines = [f"  {display_name(n)} waiting {a:.1f} s for {_ranks_text(shown(m))}"
                     for n, m, a in late]
            lines += [f"  {clash}" for clash in _operation_clashes(late, by_name, global_ranks)]
            outcome.stall_warning = (
                f"fusionring: some tensors were submitted by a subset of ranks{where} and are "
                "waiting for the rest (a rank may be stuck, or ranks run different code paths):\n"
                + "\n".join(lines))
    if stalled and stall_shutdown_s is not None:
        dead = [(n, m, a) for n, m, a in stalled if a >= stall_shutdown_s]
        if dead:
            lines = [f"{display_name(n)} (missing on {_ranks_text(shown(m))})"
                     for n, m, _ in dead]
            outcome.abort = (f"fusionring stalled for more than {stall_shutdown_s:g} s waiting for "
                             f"tensors that some ranks{where} never submitted: " + ", ".join(lines)
                             + "".join(f"; {clash}"
                                       for clash in _operation_clashes(dead, by_name,
                                                                       global_ranks)))
    return outcome


def _refusals(name: str, specs: Sequence[TensorSpec], ranks: Sequence[int],
              global_ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """The error for an operation some ranks refused (bad input raised on those ranks),
    naming each refusing rank and its reason, or None when no rank refused it."""
    by_reason: Dict[str, List[int]] = {}
    for rank, spec in zip(ranks, specs):
        if spec.refused:
            by_reason.setdefault(spec.refused, []).append(_global(rank, global_ranks))
    if not by_reason:
        return None
    kind = specs[0].kind
    return f"{kind} '{_bare(name, specs[0])}' failed on " + "; ".join(
        f"{_ranks_text(who)}, which raised {reason}" for reason, who in by_reason.items())


def _operation_clashes(stalled: Sequence[Tuple[str, List[int], float]],
                       by_name: Mapping[str, Mapping[int, Tuple[TensorSpec, float]]],
                       global_ranks: Optional[Sequence[int]] = None) -> List[str]:
    """One line per name that waiting ranks submitted as different operations (an allgather
    on one rank, an allreduce on another): each waits for the others forever."""
    kinds: Dict[str, Dict[str, List[int]]] = {}
    for name, _, _ in stalled:
        for rank, (spec, _) in by_name[name].items():
            kinds.setdefault(_bare(name, spec), {}).setdefault(spec.kind, []).append(
                _global(rank, global_ranks))
    return [f"'{bare}' is " + ", ".join(f"{kind} on {_ranks_text(sorted(ranks))}"
                                        for kind, ranks in by_kind.items())
            + ": every rank must call the same operation under a name"
            for bare, by_kind in kinds.items() if len(by_kind) > 1]


def _first_dim(spec: TensorSpec) -> int:
    return spec.shape[0] if spec.shape else 1


def _join_conflict(name: str, spec: TensorSpec, joined: Sequence[int],
                   global_ranks: Optional[Sequence[int]] = None) -> Optional[str]:
    """Why ranks that have joined cannot take part in `name`, or None when they can."""
    root_joined = spec.root in joined
    joined = [_global(r, global_ranks) for r in joined]
    # Horovod's semantics: a joined rank has no rows to gather and no part in a broadcast
    # (its root may be the joined rank itself), so both raise rather than complete.
    if spec.kind in ("allgather", "broadcast"):
        root = (f" (root rank {_global(spec.root, global_ranks)}"
                f"{' has joined' if root_joined else ''})"
                if spec.kind == "broadcast" else "")
        return (f"{spec.kind} '{_bare(name, spec)}'{root} cannot run while "
                f"{_ranks_text(joined)} {'has' if len(joined) == 1 else 'have'} called join(): "
                f"{spec.kind} is not supported with join(), as in Horovod")
    if spec.kind == "allreduce" and spec.compression:
        return (f"allreduce '{_bare(name, spec)}': {_ranks_text(joined)} called join(); "
                f"compression '{spec.compression}' reduces inside the runtime and needs every "
                f"rank's data (join() works with uncompressed and fp16 allreduces)")
    if spec.kind not in _JOINABLE_FROM_CACHE:
        return (f"{spec.kind} '{_bare(name, spec)}' cannot complete: "
                f"{_ranks_text(joined)} called join()")
    return None


def _bare(name: str, spec: TensorSpec) -> str:
    # Internal names carry the operation as a prefix.
    return name[len(spec.kind) + 1:] if name.startswith(spec.kind + ".") else name


@dataclasses.dataclass
class _CacheEntry:
    cache_id: int
    spec: TensorSpec
    first_dims: Optional[List[int]]


class Negotiator:
    """Runs the per-cycle agreement on a dedicated communicator (background thread only)."""

    def __init__(self, comm, stall_warning_s: Optional[float],
                 stall_shutdown_s: Optional[float], core, cache_capacity: int = 16384,
                 global_ranks: Optional[Sequence[int]] = None) -> None:
        self._comm = comm
        self._global_ranks = list(global_ranks) if global_ranks else None  # for messages
        # `core.band_allreduce(address, count)`: the AND of every rank's words, in place, GIL
        # released (the core's over MPI, or the shared-memory window's).
        self._core = core
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._stall_warning_s = stall_warning_s
        self._stall_shutdown_s = stall_shutdown_s
        # Names in the order they were last ready, the least recent first. Every rank sees
        # the same ready lists in the same order, so every rank keeps the same cache and
        # drops the same name when it is full.
        self._cache: "collections.OrderedDict[str, _CacheEntry]" = collections.OrderedDict()
        self._names_by_id: List[str] = []
        self._capacity = cache_capacity
        self.full_exchanges = 0
        self.cycles = 0
        self._rank_words = (self.size + 63) // 64
        self.joined_ranks: List[int] = []      # as of the last cycle
        self._joined_since: Dict[int, int] = {}  # rank -> cycle it was first seen joined

    def _cached(self, name: str, spec: TensorSpec) -> Optional[_CacheEntry]:
        entry = self._cache.get(name)
        # Requests usually share their spec object (functions.py caches them): try identity
        # first, since this runs for every pending tensor in every cycle.
        return entry if entry is not None and (entry.spec is spec or entry.spec == spec) else None

    def cached_order(self, pending: Sequence[Tuple[str, TensorSpec]]) -> Optional[List[int]]:
        """Positions of `pending` in cache-id order (the order a round makes them ready), or
        None when one of them is not cached."""
        ids = []
        for i, (name, spec) in enumerate(pending):
            entry = self._cached(name, spec)
            if entry is None:
                return None
            ids.append((entry.cache_id, i))
        return [i for _, i in sorted(ids)]

    def _id_words(self) -> int:
        """Words of one bit vector over the cached names."""
        return (len(self._names_by_id) + 63) // 64

    def round_words(self) -> int:
        """How many words the next round's AND carries."""
        return _HEADER_WORDS + self._rank_words + 2 * self._id_words()

    def cycle(self, pending: Sequence[Tuple[str, TensorSpec, float]], *, flush: bool,
              shutdown: Union[bool, str], stall_check: bool, joined: bool = False,
              idle: bool = True, reduce: Optional[Callable[[int, int], bool]] = None) -> Outcome:
        """One agreement round. `pending` holds (name, spec, age_s) per request.

        `flush` is this rank's vote to release incomplete fusion groups; it carries only
        when every rank votes, so a group is never split while a member can still come.
        `shutdown`: this rank leaves (a string: why, told to the others).
        `joined`: this rank is inside join(); `idle`: it holds nothing else unfinished.
        `reduce(address, count)`: the window's band_then_allreduce over every pending
        tensor, offered when all of them would be one fused batch; if every rank offers the
        same bytes with identical words, the batch is reduced within the round
        (`Outcome.reduced`), else the round is only the AND.
        """
        self.cycles += 1
        # Bit sets as Python ints: one conversion to words per cycle instead of a numpy
        # scalar operation per pending tensor.
        mine = 0
        uncached = False
        for name, spec, _ in pending:
            entry = self._cached(name, spec)
            if entry is None:
                uncached = True
            else:
                mine |= 1 << entry.cache_id
        if self.joined_ranks and not joined and any(
                not self._joinable(spec) for _, spec, _ in pending):
            uncached = True  # rank 0 decides: the error to raise
        if uncached or shutdown or stall_check or joined or self.joined_ranks or not pending:
            reduce = None
        flags = ((FLAG_UNCACHED if uncached else 0) | (FLAG_SHUTDOWN if shutdown else 0)
                 | (FLAG_STALL_CHECK if stall_check else 0))
        n_ids = self._id_words()
        base = _HEADER_WORDS + self._rank_words
        all_ones = (1 << (64 * n_ids)) - 1
        # Joined ranks and the OR of pending bits travel inverted through the AND.
        rank_ones = (1 << (64 * self._rank_words)) - 1
        not_joined = rank_ones
        really_pending = mine  # before a joined rank adds what it stands in for
        if joined:
            not_joined ^= 1 << self.rank
            for cache_id, name in enumerate(self._names_by_id):
                if self._joinable(self._cache[name].spec):
                    mine |= 1 << cache_id
        words = np.empty(base + 2 * n_ids, dtype=np.uint64)
        words[:_HEADER_WORDS] = (~flags & 0xFFFFFFFFFFFFFFFF, 1 if flush else 0,
                                 1 if idle and not pending else 0)
        words[_HEADER_WORDS:] = np.frombuffer(
            not_joined.to_bytes(8 * self._rank_words, "little")
            + mine.to_bytes(8 * n_ids, "little")
            + (all_ones & ~really_pending).to_bytes(8 * n_ids, "little"),
            dtype=np.uint64)
        if reduce is None:
            self._core.band_allreduce(words.ctypes.data, words.size)
            reduced = False
        else:
            reduced = reduce(words.ctypes.data, words.size)
        raw = words.tobytes()

        def field(lo: int, hi: int) -> int:  # words [lo, hi) as one integer
            return int.from_bytes(raw[8 * lo:8 * hi], "little")

        all_flags = ~field(0, 1) & 0xFFFFFFFFFFFFFFFF
        all_idle = bool(field(2, 3))
        outcome = Outcome(flush=bool(field(1, 2)), all_idle=all_idle, reduced=reduced)
        self._note_joined(rank_ones & ~field(_HEADER_WORDS, base), outcome, all_idle=all_idle)
        if all_flags & FLAG_SHUTDOWN:
            flags_by_rank = self._comm.allgather(shutdown)
            outcome.shutdown_ranks = [r for r, s in enumerate(flags_by_rank) if s]
            outcome.shutdown_reason = next(
                (s for s in flags_by_rank if isinstance(s, str)), None)
            return outcome
        if all_flags & (FLAG_UNCACHED | FLAG_STALL_CHECK):
            return self._full_exchange(pending, outcome, joined,
                                       check_stalls=bool(all_flags & FLAG_STALL_CHECK))
        # Ready: pending (or joined) on every rank, and really pending on at least one.
        everywhere = field(base, base + n_ids)
        pending_anywhere = all_ones & ~field(base + n_ids, base + 2 * n_ids)
        ready_bits = everywhere & pending_anywhere
        # Once these are done, nothing waits on any rank: the next round can only start
        # from a new submission.
        outcome.settled = not self.joined_ranks and ready_bits == pending_anywhere
        while ready_bits:
            low = ready_bits & -ready_bits
            name = self._names_by_id[low.bit_length() - 1]
            entry = self._cache[name]
            self._cache.move_to_end(name)
            outcome.ready.append(Ready(name, entry.first_dims, entry.spec))
            ready_bits ^= low
        return outcome

    @staticmethod
    def _joinable(spec: TensorSpec) -> bool:
        """Whether joined ranks can take part in `spec` decided from the cache alone."""
        return spec.kind in _JOINABLE_FROM_CACHE and not spec.compression

    def _note_joined(self, joined: int, outcome: Outcome, all_idle: bool) -> None:
        """`joined`: the bit set of ranks inside join() this round."""
        if not joined and not self._joined_since:
            self.joined_ranks = outcome.joined_ranks = []  # the usual case: nobody joined
            return
        ranks = [r for r in range(self.size) if joined >> r & 1]
        for r in ranks:
            self._joined_since.setdefault(r, self.cycles)
        for r in list(self._joined_since):
            if r not in ranks:
                del self._joined_since[r]
        self.joined_ranks = outcome.joined_ranks = ranks
        if len(ranks) == self.size and all_idle:
            latest = max(self._joined_since.values())
            outcome.join_done = True
            outcome.last_joined = max(r for r, c in self._joined_since.items() if c == latest)
            self._joined_since.clear()
            self.joined_ranks = []

    def _full_exchange(self, pending, outcome: Outcome, joined: bool = False,
                       check_stalls: bool = False) -> Outcome:
        self.full_exchanges += 1
        report = _Report(self.rank, list(pending), joined)
        reports = self._comm.gather(report, root=0)
        decided = None
        if self.rank == 0:
            # Stalls only on the rounds a rank asked to check (at most every half stall
            # limit): a name no other rank submits keeps every round a full exchange, and
            # would otherwise repeat the warning each cycle.
            decided = coordinate(reports, self._stall_warning_s if check_stalls else None,
                                 self._stall_shutdown_s if check_stalls else None,
                                 self._global_ranks)
        decided = self._comm.bcast(decided, root=0)
        specs = {name: spec for name, spec, _ in pending}
        for item in decided.ready:
            if not is_cacheable(item.name):
                continue
            spec = specs.get(item.name, item.spec)
            entry = self._cache.get(item.name)
            if entry is not None:  # same name, new spec agreed by every rank: keep the id
                entry.spec, entry.first_dims = spec, item.first_dims
                self._cache.move_to_end(item.name)
            elif len(self._names_by_id) < self._capacity:
                entry = _CacheEntry(len(self._names_by_id), spec, item.first_dims)
                self._names_by_id.append(item.name)
                self._cache[item.name] = entry
            elif self._capacity:
                # Full: the least recently ready name gives up its id. A rank that still has
                # it pending finds it uncached next cycle and negotiates it in full.
                _, dropped = self._cache.popitem(last=False)
                entry = _CacheEntry(dropped.cache_id, spec, item.first_dims)
                self._names_by_id[entry.cache_id] = item.name
                self._cache[item.name] = entry
        decided.flush, decided.all_idle = outcome.flush, outcome.all_idle
        decided.joined_ranks = outcome.joined_ranks
        decided.join_done, decided.last_joined = outcome.join_done, outcome.last_joined
        return decided
