"""What every fusionring DDP communication hook keeps between steps, and how it is saved.

A hook's state holds the process group (never saved: a group lives in one process) and, per
DDP bucket, what its codec carries from one step to the next (error-feedback residuals, shared
masks, schedule positions). Subclasses name their configuration (``config()``), build their
codec from it, and save and load the codec's tensors (``codec_state``/``load_codec_state``);
this base class makes the whole state picklable (``torch.save(state)``) and gives a
``state_dict()`` of plain types that ``torch.load(..., weights_only=True)`` reads back.
"""
import weakref
import zlib
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist


def bucket_key(bucket: dist.GradBucket, places: Optional[Sequence[int]] = None) -> str:
    """The key of a bucket's state: its position, element count and which parameters it holds.

    DDP rebuilds its buckets after the first step (in the order gradients became ready), so a
    position alone may name different parameters from one step to the next; a checksum of the
    parameters' shapes, dtypes and `places` tells such buckets apart, and a bucket whose layout
    changed starts with fresh state instead of someone else's residual. `places` are the
    parameters' positions in the order the state first met them (``HookState.key_of``): shapes
    alone cannot tell ``[a, b, c]`` from ``[c, b, a]`` when the three look alike. That first
    order is DDP's initial bucket layout, the same in every process that builds the same model
    with the same bucket sizes, so saved state finds its buckets again after a restart.
    (A new DDP model reduces its first step in its initial layout, whose state is usually
    fresh; restored buckets' state takes effect from the second step, when DDP's rebuilt
    buckets are back, and what the first step held back is carried into them then: see
    ``HookState._carry_residuals``.)
    """
    described = ";".join(f"{','.join(map(str, p.shape))}/{p.dtype}"
                         for p in bucket.parameters())
    if places is not None:
        described += "@" + ",".join(map(str, places))
    return f"{bucket.index()}:{bucket.buffer().numel()}:{zlib.crc32(described.encode()):08x}"


def mean_into_bucket(buffer: torch.Tensor, parts: Sequence[torch.Tensor],
                     add: Callable[[torch.Tensor, torch.Tensor], None], count: int,
                     device: torch.device) -> torch.Tensor:
    """Average the ranks' gathered payloads into the bucket: ``add(part, total)`` decodes one
    part onto a float32 total of `count` values on `device`, in rank order on every rank (so
    every replica gets the same bits). The total is the bucket itself where it is float32,
    contiguous and on `device`, else a temporary copied into it. Returns the bucket."""
    in_place = buffer.dtype == torch.float32 and buffer.is_contiguous() and buffer.device == device
    total = buffer.reshape(-1).zero_() if in_place else torch.zeros(
        count, dtype=torch.float32, device=device)
    for part in parts:
        add(part, total)
    total.div_(len(parts))
    if not in_place:
        buffer.copy_(total.view(buffer.shape))
    return buffer


class HookState:
    """Base of the hooks' states: the process group and per-bucket bookkeeping.

    `process_group` None means the default (world) group, as for torch's own hooks: a DDP model
    on a subgroup needs that subgroup here too. Subclasses implement ``config()``,
    ``codec_state()``, ``load_codec_state()`` and ``forget(keys)``.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if (process_group is not None and not isinstance(process_group, dist.ProcessGroup)
                and process_group == getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())):
            raise ValueError(f"{type(self).__name__}: this rank is not a member of the process "
                             f"group given as process_group= (new_group() returns a marker, "
                             f"{process_group!r}, on the ranks it leaves out); build the state "
                             f"with the group of the DDP model this rank belongs to")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"{type(self).__name__}: process_group must be a "
                            f"torch.distributed.ProcessGroup or None, not "
                            f"{type(process_group).__name__} {process_group!r}")
        self.process_group = process_group
        self._seen: Set[str] = set()     # keys used in this step so far
        self._idle: Dict[str, int] = {}  # key -> steps ended since it was last used
        # id(parameter) -> (key, offset, count): where that parameter's share of the
        # error-feedback residual was last kept (see `_carry_residuals`).
        self._owner: Dict[int, Tuple[str, int, int]] = {}
        # id(parameter) -> its position in the order this state first met the parameters
        # (DDP's initial layout); part of the bucket keys, and not saved: a restarted process
        # meets them in the same order again.
        self._places: Dict[int, int] = {}
        # The parameters of the DDP model this state serves, and of the models it served
        # before (weakly: a model dropped is forgotten), to refuse one state on two models.
        # (id -> parameter, as tensors compare by value, not identity, in a WeakSet)
        self._current: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._retired: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._agreed = False  # whether the group's ranks have compared their settings

    # ---------------------------------------------------------------- per step
    def check_hook(self, hook: str, kind: type) -> None:
        """A TypeError naming both when `hook` is given the state of another method."""
        if not isinstance(self, kind):
            raise TypeError(f"{hook} needs a {kind.__name__}, not a {type(self).__name__} "
                            f"(register each hook with its own state)")

    def agree(self, hook: str, bucket: dist.GradBucket) -> None:
        """On the first call: every rank of the group compares its settings
        (``shared_settings()``) with the others'. Ranks that differ (another n:m, another k,
        per-rank masks on one rank) would send payloads of other sizes or run other
        collectives, which ends in a transport abort or a hang: instead every rank raises a
        ValueError naming each rank's settings."""
        if self._agreed:
            return
        group = self.group()
        settings = f"{type(self).__name__}(" + ", ".join(
            f"{key}={value!r}" for key, value in sorted(self.shared_settings().items())) + ")"
        digest = zlib.crc32(settings.encode())
        # An allreduce, not an all_gather: a rank without this hook runs DDP's own allreduce of
        # the bucket at this point, and two allreduces of different sizes fail on every rank
        # ("Received data size doesn't match expected size") where an all_gather paired with an
        # allreduce waits until the group's timeout. max(d) == -max(-d) when every rank agrees.
        extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=bucket.buffer().device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        if int(extremes[0]) != -int(extremes[1]):
            described: List[Any] = [None] * group.size()
            dist.all_gather_object(described, settings, group=group)
            by_setting: Dict[str, List[int]] = {}
            for rank, text in zip(dist.get_process_group_ranks(group), described):
                by_setting.setdefault(text, []).append(rank)
            raise ValueError(f"{hook}: the ranks' hook states have different settings, so their "
                             f"payloads cannot be reduced together: " + "; ".join(
                                 f"rank{'s' if len(ranks) > 1 else ''} "
                                 f"{', '.join(map(str, ranks))}: {text}"
                                 for text, ranks in by_setting.items()))
        self._agreed = True

    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def key(self, bucket: dist.GradBucket) -> str:
        """The key of `bucket`'s state (:meth:`key_of`), noted as used in this step."""
        key = self.key_of(bucket)
        self._seen.add(key)
        self._carry_residuals(bucket, key)
        return key

    def key_of(self, bucket: dist.GradBucket) -> str:
        """The key under which this state keeps `bucket`'s state (:func:`bucket_key`)."""
        params = bucket.parameters()
        if bucket.index() == 0 and not any(id(p) in self._places for p in params):
            if any(self._retired.get(id(p)) is p for p in params):
                # Bucket keys are positions in a model's layout: two models' residuals and
                # masks would be mixed under the same keys.
                raise ValueError(
                    f"{type(self).__name__} is registered on two DDP models that train in turn "
                    f"(a bucket of the model it served before came back): give each DDP "
                    f"model its own state")
            # A new DDP model registered with this state: its parameters are met afresh, in
            # its initial layout, as a restarted process meets them.
            self._places = {}
            self._retired.update(self._current)
            self._current = weakref.WeakValueDictionary()
        places = []
        for p in params:
            place = self._places.get(id(p))
            if place is None:  # met for the first time: one pass, not one per bucket per step
                place = self._places[id(p)] = len(self._places)
                self._current[id(p)] = p
            places.append(place)
        return bucket_key(bucket, places)

    def _carry_residuals(self, bucket: dist.GradBucket, key: str) -> None:
        """Move into `key`'s residual what its parameters had left in other buckets' residuals.

        A residual is kept per bucket, and DDP rebuilds its buckets after the first step (and a
        resumed run's first step is one bucket of every parameter): without this, what such a
        bucket held back would wait under a key no bucket uses again and be dropped. Each
        parameter's slice is added at its place in this bucket and zeroed where it was, so it
        is delivered once, a step later at most."""
        held = self.residual_store()
        if held is None:
            return
        residuals, lock = held
        moves: List[Tuple[Tuple[str, int, int], int]] = []
        offset = 0
        for p in bucket.parameters():
            count = p.numel()
            where = self._owner.get(id(p))
            if where is not None and where[0] != key:
                moves.append((where, offset))
            self._owner[id(p)] = (key, offset, count)
            offset += count
        total = bucket.buffer().numel()
        if not moves or offset != total:  # a layout that is not the parameters back to back
            return
        with lock:
            target = residuals.get(key)
            for (source_key, start, count), at in moves:
                source = residuals.get(source_key)
                if source is None or source.numel() < start + count:
                    continue
                if target is None or target.numel() != total:
                    target = residuals[key] = torch.zeros(total, dtype=torch.float32,
                                                          device=source.device)
                source = source.reshape(-1)
                target.reshape(-1)[at:at + count].add_(source[start:start + count]
                                                       .to(target.device, target.dtype))
                source[start:start + count].zero_()

    def end_of_step(self, bucket: dist.GradBucket) -> None:
        """Called by a hook once it has used `bucket`. After the step's last bucket (DDP hands
        buckets over in index order), state unused for two steps is dropped: that of a layout
        DDP has since rebuilt. Two, not one: a new DDP model's first step is one bucket of every
        parameter, and a state carried over into it must outlive that step."""
        if not bucket.is_last():
            return
        for key in self._seen:
            self._idle[key] = 0
        for key in list(self._idle):
            if key not in self._seen:
                self._idle[key] += 1
        stale = [key for key, idle in self._idle.items() if idle >= 2]
        if stale:  # rare: after DDP rebuilt its buckets
            self.forget(stale)
            for key in stale:
                del self._idle[key]
        self._seen = set()

    # ---------------------------------------------------------------- subclass surface
    def config(self) -> Dict[str, Any]:
        """Constructor keyword arguments (plain types) that rebuild an equal state."""
        raise NotImplementedError

    def shared_settings(self) -> Dict[str, Any]:
        """The settings every rank of the group must share (``agree``): ``config()`` but its
        seeds, which ranks may choose apart."""
        return {key: value for key, value in self.config().items() if key != "seed"}

    def codec_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_codec_state(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def keys(self):
        """The bucket keys that hold state."""
        raise NotImplementedError

    def residual_store(self) -> Optional[Tuple[Dict[str, torch.Tensor], ContextManager]]:
        """The codec's residuals by bucket key (flat float32 tensors) and the lock that guards
        them, or None when the codec keeps none."""
        return None

    def forget(self, keys) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Configuration and per-bucket state as tensors and plain types (no process group)."""
        return {"kind": type(self).__name__, "config": self.config(), "codec": self.codec_state()}

    @classmethod
    def _check_kind(cls, state: Dict[str, Any]) -> None:
        # Before the configuration is used as another kind's keyword arguments.
        if not isinstance(state, dict) or "kind" not in state:
            raise TypeError(f"{cls.__name__}.from_state_dict needs a hook state's state_dict(), "
                            f"not {type(state).__name__}")
        if state["kind"] != cls.__name__:
            raise ValueError(f"hook state was saved by {state['kind']}, but this is "
                             f"{cls.__name__}: load it with {state['kind']}.from_state_dict")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError if it was saved by another kind or configuration."""
        if state.get("kind") != type(self).__name__ or state.get("config") != self.config():
            raise ValueError(f"hook state was saved by {state.get('kind')} with "
                             f"{state.get('config')}, but this is {type(self).__name__} with "
                             f"{self.config()}")
        self.load_codec_state(state["codec"])
        self._seen, self._idle = set(), {key: 0 for key in self.keys()}
        self._owner = {}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any],
                        process_group: Optional[dist.ProcessGroup] = None) -> "HookState":
        """A new state built from ``state_dict()``'s configuration, with its tensors loaded."""
        cls._check_kind(state)
        new = cls(process_group=process_group, **state["config"])
        new.load_state_dict(state)
        return new

    def __getstate__(self) -> Dict[str, Any]:
        # The process group cannot travel; a loaded state uses the default group until
        # `process_group` is set again.
        return self.state_dict()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        type(self).__init__(self, process_group=None, **state["config"])
        self.load_state_dict(state)
