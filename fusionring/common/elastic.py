"""``horovod.common.elastic``'s names: the framework-neutral elastic state and ``run_fn``.

Used by :mod:`fusionring.torch.elastic` for a fixed set of ranks: the MPI world of an
mpiexec launch never changes, so no host update arrives from a launcher (a script may still
report one with ``State.on_hosts_updated``), and a failed rank cannot be replaced: a
``HorovodInternalError`` rolls the state back to the last commit and is raised again,
saying so. Imports no framework, like Horovod's module.
"""
from __future__ import annotations

import copy
import enum
import functools
import queue
from typing import Any, Callable, Dict, Iterable, List, Tuple, TypeVar

from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState",
           "State", "run_fn"]

_F = TypeVar("_F", bound=Callable[..., Any])


class HostUpdateResult(enum.IntFlag):
    """What changed in a host update (Horovod's values: ``mixed`` is both)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """State kept in memory on every rank: committed, restored and synced together.

    Args:
        bcast_object: broadcasts an object from rank 0 and returns it on every rank.
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[Tuple[Any, HostUpdateResult]]" = queue.Queue()
        self._last_updated_timestamp: Any = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Add functions called after a reset event, before the state is synced again."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"reset callbacks must be callable, got "
                                f"{type(callback).__name__}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Drop host updates not acted on, reset this state's objects, then run the
        registered reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: Any, update_res: HostUpdateResult) -> None:
        """Report a host update (`timestamp` orders updates); the next ``commit()`` or
        ``check_host_updates()`` raises ``HostsUpdatedInterrupt`` on every rank if rank 0
        has one newer than the last it acted on.

        Launchers that change the set of ranks call this; under mpiexec nothing does, so
        only a script's own call reaches it.
        """
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Save the state (the point ``restore()`` returns to), then check for host updates."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if rank 0 was told of a host update
        newer than the last one acted on (a collective call, on every rank).

        The interrupt's ``skip_sync`` is set when hosts were only removed.
        """
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while True:
            try:
                timestamp, result = self._host_messages.get_nowait()
            except queue.Empty:
                break
            if timestamp > last:
                last = timestamp
                update |= result
        # Rank 0's view is everyone's, so that every rank raises at the same commit.
        prev, self._last_updated_timestamp, update = self._bcast_object((prev, last, update))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def save(self) -> None:
        """Save the state to host memory."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Return to the last saved state, undoing changes made since."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")

    def reset(self) -> None:
        """Reset objects after a reset event, before the state is synced."""
        return None


def _deepcopy(value: Any, name: str) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception as exc:  # noqa: BLE001 - any failure of an arbitrary object's copy
        raise TypeError(f"elastic state attribute '{name}' ({type(value).__name__}) cannot be "
                        f"deep-copied, so it cannot be committed or restored: {exc}") from exc


def _check_attribute_name(cls: type, name: str) -> None:
    if name.startswith("_") or hasattr(cls, name):
        raise ValueError(f"'{name}' cannot be an elastic state attribute: it starts with '_' or "
                         f"is the name of a {cls.__name__} method")


class ObjectState(State):
    """State made of plain Python attributes, one per keyword argument.

    ``save`` keeps deep copies, so later in-place changes (``state.history.append(x)``)
    are undone by ``restore``; ``sync`` broadcasts rank 0's last committed values with
    `bcast_object`, dropping changes not committed yet on every rank, as in Horovod.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        for name in kwargs:
            _check_attribute_name(type(self), name)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._saved_state: Dict[str, Any] = {name: _deepcopy(value, name)
                                             for name, value in kwargs.items()}
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved_state = {name: _deepcopy(getattr(self, name), name)
                             for name in self._saved_state}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if not self._saved_state:
            return
        # The committed values, not the current ones: a rank may have changed attributes
        # since its last commit (the step that failed, say).
        self._saved_state = self._bcast_object(self._saved_state)
        self.restore()


def _fixed_world_error(exc: BaseException) -> BaseException:
    message = (f"{exc}\nThe elastic state was restored to its last commit, but training cannot "
               f"go on in this launch: recovering from a failed rank needs a launcher that can "
               f"replace ranks, and the MPI world of an mpiexec launch is fixed. Restart the job "
               f"(e.g. from a checkpoint of the committed state).")
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - a subclass whose constructor takes other arguments
        return HorovodInternalError(message)


def run_fn(func: _F, reset: Callable[[], None]) -> _F:
    """Wrap the elastic training function ``func(state, *args, **kwargs)``.

    Syncs `state` from rank 0, then calls `func`. A ``HostsUpdatedInterrupt`` raised by
    `func` calls `reset`, then ``state.on_reset()``, and calls `func` again (syncing first
    unless the interrupt says to skip it), as in Horovod. A ``HorovodInternalError``
    restores the last committed state and is raised again: the ranks of an mpiexec launch
    are fixed, so a failed rank cannot be replaced.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"the first argument of an elastic function must be an elastic "
                            f"State (e.g. hvd.elastic.TorchState), not {type(state).__name__}")
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError as exc:
                state.restore()
                raise _fixed_world_error(exc) from exc
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            reset()
            state.on_reset()

    return wrapper  # type: ignore[return-value]
