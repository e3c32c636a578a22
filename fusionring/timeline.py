"""Chrome-trace timeline (chrome://tracing, Perfetto): one span per group and phase.

Spans carry Horovod's activity names (NEGOTIATE_ALLREDUCE, ALLREDUCE,
MEMCPY_IN_FUSION_BUFFER, ..., CYCLE_START marks), so a trace reads as Horovod's documentation
describes and tools written for Horovod's timelines keep working; each span's args name
fusionring's phase too (negotiate, pack, compress, reduce, unpack, ...).
"""
from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import os
import sys
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .config import HOROVOD_VARIABLES

# phase name, start, end (time.perf_counter seconds)
PhaseRecorder = Callable[[str, float, float], None]
_recorder: "contextvars.ContextVar[Optional[PhaseRecorder]]" = contextvars.ContextVar(
    "fusionring_phase_recorder", default=None)


@contextlib.contextmanager
def recording_phases(timeline: Optional["Timeline | LaneView"], lane: str,
                     args: Optional[dict] = None) -> Iterator[None]:
    """While active, phase_recorder() hands code that runs a reduction (a compressor's
    communicate) a function that records its phases on `lane` of `timeline`."""
    if timeline is None:
        yield
        return
    token = _recorder.set(lambda phase, start, end: timeline.span(lane, phase, start, end, args))
    try:
        yield
    finally:
        _recorder.reset(token)


def phase_recorder() -> Optional[PhaseRecorder]:
    """The recorder set by recording_phases in this context, or None when nothing records.
    Fetch it on the calling thread: helper threads do not inherit the context."""
    return _recorder.get()


# Phases whose activity name does not depend on the operation.
_ACTIVITIES = {"pack": "MEMCPY_IN_FUSION_BUFFER", "unpack": "MEMCPY_OUT_FUSION_BUFFER",
               "compress": "COMPRESS", "decompress": "DECOMPRESS"}
CYCLE_MARK = "CYCLE_START"
# Written at least this often while spans arrive, and after every cycle that ran operations
# (Runtime calls flush()), so a running job's file shows what has completed.
_FLUSH_EVERY_S = 0.5
# Follows the events in the file after every flush; the next batch is written over it.
_CLOSING = b"\n]\n"


def activity(phase: str, kind: str = "allreduce", transport: Optional[str] = None) -> str:
    """Horovod's name for `phase` of an operation of `kind`: negotiate -> NEGOTIATE_ALLREDUCE,
    operation -> ALLREDUCE (the whole processing), reduce -> RING_ALLREDUCE (SHM_ALLREDUCE
    through the shared-memory window), pack -> MEMCPY_IN_FUSION_BUFFER, ..."""
    if phase == "negotiate":
        return f"NEGOTIATE_{kind.upper()}"
    if phase == "operation":
        return kind.upper()
    if phase == "reduce":
        return f"{'SHM' if transport == 'shared memory' else 'RING'}_{kind.upper()}"
    return _ACTIVITIES.get(phase, phase.upper())


class TimelineError(OSError):
    """The timeline file cannot be opened; raised on every rank alike (rank 0 writes it)."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


# What a rank that could not open the timeline tells the others: (errno, the message).
Failure = Tuple[int, str]


def open_failure(exc: OSError, path: str, what: str) -> Failure:
    """The Failure for `exc`, raised opening `path` as `what` asked (a setting or a call)."""
    reason = exc.strerror or str(exc)
    if exc.filename and os.path.abspath(exc.filename) != os.path.abspath(path):
        reason = f"cannot create the directory {exc.filename}: {reason}"
    elif exc.errno == errno.EISDIR:
        reason = "it is a directory; name a file (missing directories are created)"
    return exc.errno or errno.EIO, f"{what}: rank 0 cannot open the timeline file: {reason}"


def timeline_variable() -> str:
    """The variable that named the timeline at init, for messages: FUSIONRING_TIMELINE, or
    Horovod's name for it when only that is set (config.settings() read the value)."""
    horovod = HOROVOD_VARIABLES["TIMELINE"]
    if os.environ.get(horovod, "").strip() and not os.environ.get("FUSIONRING_TIMELINE", "").strip():
        return horovod
    return "FUSIONRING_TIMELINE"


class Timeline:
    """Streams trace events to a JSON file; written by rank 0 only.

    Directories missing from `path` are created. Events are written in batches: at flush()
    (after each cycle that ran operations) or every _FLUSH_EVERY_S while spans arrive. Each
    batch goes out with the closing ``]`` after it, and the next batch is written over that
    bracket, so the file is a complete JSON array after every flush, as Horovod's is: it loads
    while the job runs, and after a rank was killed.
    """

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = os.path.abspath(path)
        self.mark_cycles = mark_cycles
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._end = 0  # where the next batch goes: over the closing bracket
        self._pending: List[str] = []
        self._first = True
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._tids: Dict[str, int] = {}
        self._flushed = time.monotonic()
        try:
            self._write("[")
        except OSError:
            os.close(self._fd)
            raise

    def writes_to(self, path: str) -> bool:
        """Whether `path` names this timeline's file (relative to the current directory)."""
        return os.path.abspath(path) == self.path

    def _write(self, text: str) -> None:
        """Write `text` then the closing bracket at the end of the events; under the lock."""
        data = text.encode()
        view = memoryview(data + _CLOSING)
        offset = self._end
        while view:  # a regular file takes it all at once, short of a full disk
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written
        self._end += len(data)

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._fd is None:
                return
            self._pending.append(("\n" if self._first else ",\n") + json.dumps(event))
            self._first = False
            if time.monotonic() - self._flushed > _FLUSH_EVERY_S:
                self._flush_locked()

    def _flush_locked(self) -> None:
        self._flushed = time.monotonic()
        if not self._pending:
            return
        text = "".join(self._pending)
        self._pending.clear()
        try:
            self._write(text)
        except OSError as exc:
            # A full disk must not stop training: the file keeps what it had (a part of the
            # batch that went out is cut off again), and recording stops.
            try:
                os.ftruncate(self._fd, self._end)
                os.pwrite(self._fd, _CLOSING, self._end)
            except OSError:
                pass
            print(f"fusionring: cannot write the timeline {self.path}: {exc.strerror or exc}; "
                  f"recording stopped", file=sys.stderr, flush=True)
            self._close_locked()

    def flush(self) -> None:
        """Hand what was recorded so far to the file."""
        with self._lock:
            if self._fd is not None:
                self._flush_locked()

    def _tid(self, lane: str) -> int:
        tid = self._tids.get(lane)
        if tid is None:
            tid = self._tids[lane] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                        "args": {"name": lane}})
        return tid

    def span(self, lane: str, phase: str, start: float, end: float,
             args: Optional[dict] = None, kind: str = "allreduce") -> None:
        """A completed phase (negotiate, operation, pack, compress, reduce, unpack, ...) of an
        operation of `kind` on `lane`, under Horovod's name for it (see `activity`)."""
        args = dict(args or {}, phase=phase)
        event = {"name": activity(phase, kind, args.get("transport")), "ph": "X", "pid": 0,
                 "tid": self._tid(lane), "ts": self._us(start),
                 "dur": round((end - start) * 1e6, 3), "args": args}
        self._emit(event)

    def mark(self, name: str, when: Optional[float] = None) -> None:
        """An instant marker across the whole trace (e.g. one per cycle)."""
        self._emit({"name": name, "ph": "i", "s": "g", "pid": 0, "tid": 0,
                    "ts": self._us(time.perf_counter() if when is None else when)})

    def mark_cycle(self) -> None:
        """The per-cycle marker, when this timeline records cycles."""
        if self.mark_cycles:
            self.mark(CYCLE_MARK)

    def _close_locked(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Write what is left and close the file (a no-op the second time)."""
        with self._lock:
            if self._fd is not None:
                self._flush_locked()
                self._close_locked()


class LaneView:
    """A Timeline seen through a lane prefix: how a process set's runtime records into the
    process's one timeline file. Cycle marks stay the global runtime's."""

    def __init__(self, target: Timeline, prefix: str) -> None:
        self.target = target
        self.prefix = prefix

    def span(self, lane: str, phase: str, start: float, end: float,
             args: Optional[dict] = None, kind: str = "allreduce") -> None:
        self.target.span(self.prefix + lane, phase, start, end, args, kind)

    def flush(self) -> None:
        self.target.flush()

    def mark(self, name: str, when: Optional[float] = None) -> None:
        self.target.mark(self.prefix + name, when)

    def mark_cycle(self) -> None:
        pass
