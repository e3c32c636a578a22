"""Chrome-trace timeline (chrome://tracing, Perfetto): one span per group and phase."""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
from typing import Callable, Dict, Iterator, Optional

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


class Timeline:
    """Streams trace events to a JSON file; written by rank 0 only."""

    def __init__(self, path: str, mark_cycles: bool = True) -> None:
        self.mark_cycles = mark_cycles
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "w")
        self._file.write("[\n")
        self._first = True
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._tids: Dict[str, int] = {}

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._first = False

    def _tid(self, lane: str) -> int:
        tid = self._tids.get(lane)
        if tid is None:
            tid = self._tids[lane] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                        "args": {"name": lane}})
        return tid

    def span(self, lane: str, phase: str, start: float, end: float,
             args: Optional[dict] = None) -> None:
        """A completed phase (negotiate, pack, compress, reduce, unpack, ...) on `lane`."""
        event = {"name": phase, "ph": "X", "pid": 0, "tid": self._tid(lane),
                 "ts": self._us(start), "dur": round((end - start) * 1e6, 3)}
        if args:
            event["args"] = args
        self._emit(event)

    def mark(self, name: str, when: Optional[float] = None) -> None:
        """An instant marker across the whole trace (e.g. one per cycle)."""
        self._emit({"name": name, "ph": "i", "s": "g", "pid": 0, "tid": 0,
                    "ts": self._us(time.perf_counter() if when is None else when)})

    def mark_cycle(self) -> None:
        """The per-cycle marker, when this timeline records cycles."""
        if self.mark_cycles:
            self.mark("cycle")

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write("\n]\n")
                self._file.close()


class LaneView:
    """A Timeline seen through a lane prefix: how a process set's runtime records into the
    process's one timeline file. Cycle marks stay the global runtime's."""

    def __init__(self, target: Timeline, prefix: str) -> None:
        self.target = target
        self.prefix = prefix

    def span(self, lane: str, phase: str, start: float, end: float,
             args: Optional[dict] = None) -> None:
        self.target.span(self.prefix + lane, phase, start, end, args)

    def mark(self, name: str, when: Optional[float] = None) -> None:
        self.target.mark(self.prefix + name, when)

    def mark_cycle(self) -> None:
        pass
