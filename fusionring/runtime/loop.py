"""The runtime's control loop: requests in, one negotiation round per cycle, fused batches
and collectives out, handles completed. One Runtime per process (and per process set)."""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from ..config import Settings, settings
from ..dtypes import real_view
from ..exceptions import FusionRingError, StallError, TensorMismatchError
from ..negotiation import Negotiator, Ready, TensorSpec, display_name
from ..ops import ADASUM_CODE, ReduceOp, core_reduction
from ..process_exit import exit_nonzero_without_finalize, unlink_mpi_shared_memory
from ..scheduler import THRESHOLD, Entry, FusedBatch, FusionScheduler
from ..timeline import Failure as TimelineFailure, LaneView, Timeline, TimelineError
from ..timeline import open_failure, timeline_variable
from .allreduce import (AllreduceOps, CompressedAllreduce, NcclAllreduce, RingAllreduce,
                        SharedMemoryAllreduce, lane)
from .collectives import MpiCollectives
from .nccl import NcclTransport, ready_event
from .nccl_collectives import NcclCollectives
from .requests import Request, Stats
from .topology import (HostLayout, wait_mode, wait_policy, wants_shared_memory,
                       warn_unless_thread_multiple)

_QUIET_CYCLES_BEFORE_BACKOFF = 50
_QUIET_BACKOFF = 10
# With nothing in flight on any rank, a loop waits this long for a submission of its own
# before the next cycle (a submission or a shutdown still starts one at once).
_ALL_IDLE_WAIT_S = 0.05
# A burst of submissions (a backward pass's gradients) waits at most this many cycle times
# for the rest of itself before it is negotiated.
_BURST_CYCLES = 5
# How long a loop whose caller is blocked runs rounds back to back before it goes back to
# timed cycles (a late rank usually submits within this; a stuck one is left to stall checks).
_EAGER_ROUNDS_S = 0.05
# How long a rank that failed inside an agreed operation waits for its peers to take its
# shutdown notice (an idle loop cycles every 50 ms) before it aborts the job instead.
_FAREWELL_WAIT_S = 10.0
# The tensor of a refusal (Runtime.refuse): it carries only its name and reason.
_NOTHING = torch.empty(0, dtype=torch.uint8)
# How long a rank at exit waits for the others to reach their exit too before the
# shared-memory windows are freed together (MPI_Finalize waits for them anyway).
_SHM_CLOSE_WAIT_S = 60.0
_windows_to_close: List["_C.SharedMemoryAllreduce"] = []

class Runtime:
    """One per process: owns the communicators, the queue and the background thread."""

    def __init__(self, comm=None, config: Optional[Settings] = None,
                 global_ranks: Optional[List[int]] = None,
                 timeline_owner: Optional["Runtime"] = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._pid = os.getpid()  # a forked child (a DataLoader worker) inherits this object
        self._set_aside = None  # the shared-memory window left for exit by shutdown()
        warn_unless_thread_multiple(MPI)
        self.config = config or settings()
        base = comm if comm is not None else MPI.COMM_WORLD
        self.base_comm = base
        # For a process set's runtime: the global rank of each of its ranks (None: global).
        self.global_ranks = global_ranks
        # Separate communicators: user code may use COMM_WORLD freely alongside us.
        self._control_comm = base.Dup()
        self._data_comm = base.Dup()
        # The process's timeline file belongs to the global runtime; a process set's runtime
        # (timeline_owner: the global one) records into it, on lanes named for its ranks.
        self._timeline_owner = timeline_owner
        self._own_timeline: Optional[Timeline] = None
        if timeline_owner is None:
            # Every rank learns whether rank 0 could open the file, so that all of them fail
            # here together instead of rank 0 alone while the others wait in a collective.
            failure: Optional[TimelineFailure] = None
            path = self.config.timeline_path
            if path and base.Get_rank() == 0:
                try:
                    self._own_timeline = Timeline(path,
                                                  mark_cycles=self.config.timeline_mark_cycles)
                except OSError as exc:
                    failure = open_failure(exc, path, f"{timeline_variable()}={path!r}")
            failure = self._control_comm.bcast(failure, root=0)
            if failure is not None:
                for comm in (self._control_comm, self._data_comm):
                    comm.Free()
                raise TimelineError(*failure)
        self._timeline_view: Optional[LaneView] = None
        self.layout = HostLayout.gather(base, MPI)
        self.rank, self.size = self.layout.rank, self.layout.size
        self.local_rank, self.local_size = self.layout.local_rank, self.layout.local_size
        # The cores each rank of this host may run on (its affinity), in local-rank order.
        self.local_cores: List[List[int]] = self.layout.local_cores
        self.cross_rank, self.cross_size = self.layout.cross_rank, self.layout.cross_size
        self._core = _C.Communicator(MPI._handleof(self._data_comm))
        control_core = _C.Communicator(MPI._handleof(self._control_comm))
        self.mpi_wait = wait_mode(self.config, self.layout)
        spin_us, sleep_us = wait_policy(self.config, self.layout)
        if sleep_us > 0:
            for core in (self._core, control_core):
                core.set_wait_policy(spin_us, sleep_us)
        self._shm = (_C.SharedMemoryAllreduce(MPI._handleof(self._data_comm),
                                              self.config.shm_slot_bytes)
                     if wants_shared_memory(self.config, self.layout) else None)
        # With more ranks than cores on this host, the round's AND goes through the window:
        # one wait (a short spin, then a futex sleep that hands the core to a peer still
        # computing) instead of an MPI allreduce's 2(P-1) polled ones. With a core per rank
        # the polled AND answers sooner (2 ranks: 0.57 against 0.61 s, bench_small.py).
        band_core = (self._shm if self._shm is not None and self.layout.oversubscribed()
                     else control_core)
        # Where the AND goes through the window, a round whose pending tensors would be one
        # fused batch through the window anyway carries their data too (the window's
        # band_then_allreduce): one wait per step fewer, and no second pass of the loop.
        self._reduce_in_round = band_core is self._shm and self._shm is not None
        self._negotiator = Negotiator(self._control_comm, self.config.stall_warning_s,
                                      self.config.stall_shutdown_s, band_core,
                                      cache_capacity=self.config.cache_capacity,
                                      global_ranks=global_ranks)
        self._scheduler = FusionScheduler(None, self.config.fusion_threshold_bytes)
        self._group_sets: Dict[str, List[List[str]]] = {}  # label -> its groups, oldest first
        self._group_labels = itertools.count()
        self._group_submissions = itertools.count()
        self.stats = Stats()

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: List[Request] = []
        # Submissions of a burst (a backward pass's gradients) wait in the queue, so that one
        # round negotiates them together, until the burst ends, a few cycle times pass, a
        # caller blocks, or they fill a fusion buffer; anything else starts a round at once.
        self._burst_since: Optional[float] = None
        self._burst_bytes = 0
        self._start_now = False
        self._poked = False  # a caller started waiting while the loop was idle
        # Long enough for a small model's backward pass on a shared core (1-3 ms measured).
        self._burst_window_s = _BURST_CYCLES * self.config.cycle_time_ms / 1000.0
        # When the loop sleeps between cycles: until when (None while it runs a cycle).
        self._idle_until: Optional[float] = None
        # A burst that outlasts the window (a long backward pass) is not held back at all:
        # its rounds start as its tensors arrive, so reduction overlaps the backward pass.
        self._burst_started: Optional[float] = None
        self._long_bursts = False
        # With a core per rank, a round started at the first gradient costs no peer anything
        # and overlaps the rest of the pass (2 ranks on 2 cores: 0.57 s held against 0.53 s
        # not, bench_small.py); with more ranks than cores, holding gave 1.02 against 1.34 s.
        self._hold_bursts = (self.config.bursts == "on" or self.config.bursts == "auto"
                             and self.layout.oversubscribed())
        self._pending: "collections.OrderedDict[str, Request]" = collections.OrderedDict()
        self._handles: Dict[int, Request] = {}
        self._in_flight: Dict[str, Request] = {}
        self._handle_ids = itertools.count()
        self._waiters = 0
        self._shutdown_requested = False
        self._shutdown_reason: Optional[str] = None
        self._farewell_pending = False  # see _abort_after_agreement
        self._refusals = 0  # refusals in flight or deferred (see refuse)
        # Refusals of a name whose earlier refusal is still in flight, oldest first.
        self._deferred_refusals: Dict[str, collections.deque] = {}
        self._failure: Optional[BaseException] = None
        self._last_stall_check = time.monotonic()
        self._last_stall_warning: Optional[float] = None
        self._quiet_cycles = 0
        self._eager_since: Optional[float] = None  # back-to-back rounds for a waiting caller
        self._join_request: Optional[Request] = None  # set while this rank is inside join()
        # A fused allreduce batch goes to the first of these ops that takes it.
        self._shm_op = SharedMemoryAllreduce(self)
        self._allreduce_ops = AllreduceOps([NcclAllreduce(self), CompressedAllreduce(self),
                                            self._shm_op, RingAllreduce(self)])
        self._nccl: Optional[NcclTransport] = None  # made by the first batch of CUDA tensors
        # Collectives other than allreduce, one request at a time, in response order.
        self._mpi = MpiCollectives(self)
        self._collectives: Dict[str, Callable[[List[Request]], None]] = self._mpi.by_kind()
        self._gpu_collectives = NcclCollectives(self).by_kind()
        self._thread = threading.Thread(target=self._loop, name="fusionring-loop", daemon=True)
        self._thread.start()

    def nccl(self) -> NcclTransport:
        """This runtime's NCCL transport, made by its first collective of CUDA tensors (the
        communicator itself is created there, collectively, on the tensors' GPU)."""
        if self._nccl is None:
            self._nccl = NcclTransport(self._data_comm, self.rank, self.size,
                                       self.config.stall_shutdown_s)
        return self._nccl

    @property
    def gpu(self) -> Optional[torch.device]:
        """The GPU this runtime's NCCL collectives run on, once the first one has run."""
        return self._nccl.device if self._nccl is not None else None

    def packs_fused_batches(self) -> bool:
        """Whether threshold fusion copies a batch into a fusion buffer and back, unless its
        tensors already lie back to back in batch order (without a shared-memory window)."""
        return self._shm is None

    def host_cores(self) -> int:
        """How many distinct cores the ranks of this host may run on, together."""
        return self.layout.host_cores()

    def core_share(self) -> float:
        """How many cores this rank has to itself: each core it may run on counts 1/k when k
        ranks of this host may run there (ranks bound to their own cores: all of them)."""
        return self.layout.core_share()

    @property
    def shared_memory(self) -> bool:
        """Whether dense allreduces go through the shared-memory window."""
        return self._shm is not None

    # ------------------------------------------------------------------ caller side
    def submit(self, request: Request, burst: bool = False) -> int:
        """Queue a request; returns its handle. Raises ValueError for a name in flight.

        `burst`: more submissions follow soon (a backward pass's gradients), so the next round
        may wait for them, until end_burst(), a caller blocks, or a few cycle times pass.
        """
        self._check_process()
        while True:
            with self._lock:
                # Checked inline first: every gradient of every step is submitted here.
                refused = self._refused_in_flight([request]) if self._refusals else None
                if refused is None:
                    self._check_submittable([request])
                    return self._enqueue(request, burst)
            self._await_refusal(refused)

    def submit_many(self, requests: List[Request], burst: bool = False
                    ) -> Tuple[List[int], Optional[ValueError]]:
        """Queue several independent requests (each negotiated on its own, as with submit)
        under one hold of the lock. Returns the handles of those queued and, when one's name
        is in flight or repeated, its error: the ones before it are queued, it and the rest
        are not, as that many submit() calls would leave them."""
        self._check_process()
        handles: List[int] = []
        try:
            with self._lock:
                if not self._refusals or self._refused_in_flight(requests) is None:
                    for request in requests:
                        self._check_submittable([request])
                        handles.append(self._enqueue(request, burst))
                    return handles, None
            for request in requests:  # waits out a refusal
                handles.append(self.submit(request, burst))
        except ValueError as exc:
            return handles, exc
        return handles, None

    def submit_group(self, requests: List[Request], burst: bool = False) -> List[int]:
        """Queue several requests at once (a grouped collective), so the loop negotiates and
        fuses them together; returns their handles. Nothing is queued when one fails."""
        self._check_process()
        while True:
            with self._lock:
                refused = self._refused_in_flight(requests)
                if refused is None:
                    break
            self._await_refusal(refused)
        with self._lock:  # released only to wait: nothing else submits under these names
            self._check_submittable(requests)
            group = next(self._group_submissions)
            for place, request in enumerate(requests):
                request.group_place = (group, place)
                # Every member carries the group's size, so ranks that group differently
                # fail at once on the first name they share, instead of waiting forever for
                # members only some of them sent.
                request.spec = dataclasses.replace(request.spec, group=len(requests))
            return [self._enqueue(request, burst) for request in requests]

    def refuse(self, names: Sequence[str], kind: str, reason: str) -> None:
        """Tell the other ranks that this rank refused the operations `names` (bad input,
        raised to its own caller): their matching operations then fail naming this rank and
        `reason` instead of waiting for it. Nothing is sent with one rank, after a failure
        or shutdown, or for a name already in flight as an operation (the others match that
        one). A name refused again while its earlier refusal is unsettled queues behind it:
        every rank's refusals and operations of one name then meet in the order each rank
        made them, however far apart the ranks run."""
        if self.size == 1 or os.getpid() != self._pid:
            return
        with self._lock:
            if self._failure is not None or self._shutdown_requested:
                return
            for name in names:
                pending = self._in_flight.get(name)
                if pending is not None and not pending.spec.refused:
                    continue
                refusal = Request(name, TensorSpec(kind, "", (), refused=reason), _NOTHING, None)
                self._refusals += 1
                if pending is None:
                    self._enqueue(refusal, burst=False)
                else:
                    self._deferred_refusals.setdefault(name, collections.deque()).append(refusal)

    def _refused_in_flight(self, requests: List[Request]) -> Optional[Request]:
        # Under the lock. A name refused here a moment ago may be submitted again at once
        # (a caller that caught the error and retries): it waits until the refusal is
        # settled, which takes one round once every rank has submitted the name (and so does
        # each refusal of the name queued behind it, see refuse).
        if not self._refusals:
            return None
        for request in requests:
            pending = self._in_flight.get(request.name)
            if pending is not None and pending.spec.refused:
                return pending
        return None

    def _await_refusal(self, refused: Request) -> None:
        while not refused.done.wait(0.1):
            if not self._thread.is_alive():
                raise FusionRingError("the fusionring background loop has stopped")

    def _check_process(self) -> None:
        # Before the lock: a fork may have copied it held by the loop, which the child lacks.
        if os.getpid() != self._pid:
            rank = self.rank if self.global_ranks is None else self.global_ranks[self.rank]
            raise FusionRingError(
                f"process {os.getpid()} was forked from rank {rank} (process {self._pid}), a "
                f"DataLoader worker for example: it is no rank and cannot take part in "
                f"collectives; call them in the rank's own process")

    def _check_submittable(self, requests: List[Request]) -> None:
        # Under the lock.
        if self._failure is not None:
            raise FusionRingError(str(self._failure))
        if self._shutdown_requested:
            raise FusionRingError("fusionring has been shut down on this rank")
        names = set()
        for request in requests:
            if request.name in self._in_flight or request.name in names:
                raise ValueError(
                    f"a tensor named '{request.name}' is already in flight; every pending "
                    f"operation needs a unique name (synchronize the earlier one first)")
            names.add(request.name)

    def _enqueue(self, request: Request, burst: bool) -> int:
        # Under the lock.
        request.handle = next(self._handle_ids)
        request.submitted_at = time.monotonic()
        self._handles[request.handle] = request
        self._in_flight[request.name] = request
        self._queue.append(request)
        if burst and self._burst_started is None:
            self._burst_started = request.submitted_at
        # The loop is woken only when what it waits for changes: a start, or a burst whose
        # deadline comes before the loop's own next cycle. Waking it for each gradient of
        # a held burst costs a thread switch apiece, taken from the training threads
        # where ranks share cores.
        was_started, was_held = self._start_now, self._burst_since is not None
        if not burst or self._long_bursts or not self._hold_bursts:
            self._start_now = True
        elif self._burst_since is None:
            self._burst_since = request.submitted_at  # the loop sets its deadline by it
        self._burst_bytes += request.nbytes if burst else 0
        if self._burst_bytes >= self.config.fusion_threshold_bytes:
            self._start_now = True
        if (self._start_now and not was_started) or (
                self._burst_since is not None and not was_held
                and self._idle_until is not None
                and self._burst_since + self._burst_window_s < self._idle_until):
            self._wakeup.notify()
        return request.handle

    def end_burst(self) -> None:
        """The burst being submitted is complete: negotiate it now."""
        with self._lock:
            self._close_burst()
            if self._burst_since is not None:
                self._start_now = True
                self._wakeup.notify()

    def _close_burst(self) -> None:
        # Under the lock. How long this burst took decides whether the next one is gathered.
        if self._burst_started is not None:
            took = time.monotonic() - self._burst_started
            self._long_bursts = took > self._burst_window_s
            self._burst_started = None

    def _request(self, handle: int) -> Request:
        try:
            return self._handles[handle]
        except (KeyError, TypeError):
            raise ValueError(f"unknown handle {handle!r}: it was never returned by an async "
                             f"operation, or has already been synchronized") from None

    def poll(self, handle: int) -> bool:
        """True when the operation behind `handle` has finished (successfully or not)."""
        return self._request(handle).done.is_set()

    def wait(self, handle: int) -> Request:
        """Block until `handle` completes; release it; raise its error if it failed."""
        request = self._request(handle)
        if not request.done.is_set():
            with self._lock:
                self._waiters += 1
                self._close_burst()  # a caller waiting ends a burst not ended otherwise
                if self._burst_since is not None:
                    self._start_now = True  # ...and releases what the loop holds of it
                self._poked = True
                self._wakeup.notify()
            try:
                while not request.done.wait(0.1):
                    if not self._thread.is_alive() and not request.done.is_set():
                        raise FusionRingError("the fusionring background loop has stopped")
            finally:
                with self._lock:
                    self._waiters -= 1
        with self._lock:
            self._handles.pop(handle, None)
        if request.error is not None:
            raise request.error
        return request

    def set_fusion_groups(self, groups: Optional[Sequence[Sequence[str]]],
                          label: str = "fusion_groups") -> None:
        """Install plan groups (lists of tensor names) under `label` on every rank; None
        removes that label's groups (its tensors go by threshold fusion).

        Groups under different labels (e.g. one per optimizer of a GAN) are in force together;
        a tensor name that a later label groups again leaves the earlier label's group. A
        collective: every rank must call it with the same groups. It is negotiated like a
        tensor, so all ranks switch in the same cycle, and differing groups raise a
        TensorMismatchError on every rank.
        """
        groups = [list(g) for g in groups] if groups else None
        digest = hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16]
        request = Request(f"fusion_groups.{label}", TensorSpec("fusion_groups", "none", (),
                                                               detail=f"groups {digest}"),
                          torch.empty(0, dtype=torch.uint8), None, payload=(label, groups))
        self.wait(self.submit(request))

    def new_group_label(self) -> str:
        """A fresh label for set_fusion_groups. Every rank of this runtime gets the same
        sequence, as long as they create their optimizers in the same order (a process set's
        members do, whatever other sets they are in)."""
        return f"optimizer.{next(self._group_labels)}"

    def shutdown(self, timeout_s: float = 30.0, reason: Optional[str] = None) -> None:
        """Tell every rank this one is leaving, then stop the background loop; operations
        still pending fail with `reason` (default: naming the ranks that shut down)."""
        with self._lock:
            self._shutdown_requested = True
            self._shutdown_reason = reason
            self._wakeup.notify()
        # A loop that failed may be saying farewell to peers that are gone: do not wait long,
        # unless it is deciding whether to abort the job (peers stuck inside a collective).
        if self._farewell_pending:
            self._thread.join(_FAREWELL_WAIT_S + 5.0)
        else:
            self._thread.join(timeout_s if self._failure is None else min(timeout_s, 1.0))
        if self._timeline_owner is None:
            self.stop_timeline()
        nccl, self._nccl = self._nccl, None
        if nccl is not None and not self._thread.is_alive():
            nccl.close()
        shm, self._shm = self._shm, None
        if shm is not None and not self._thread.is_alive():
            # Freeing is collective, and this rank may shut down long before the others:
            # the window is freed at exit (MPICH over libfabric fails MPI_Finalize while one
            # is allocated), so that shutdown() itself never waits for them.
            _windows_to_close.append(shm)
            self._set_aside = shm
        for comm in (self._control_comm, self._data_comm):
            try:
                comm.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalized at exit
                pass

    def free_shared_memory(self, timeout_s: float = 10.0) -> None:
        """Free the shared-memory window this runtime set aside at shutdown now, not at exit.

        Only for a shutdown every rank of the runtime makes together (``remove_process_set``):
        the free is collective, and without it each removed set would hold its window (a few
        MB a rank) until the process ends. Ranks that do not arrive within `timeout_s` leave
        it to exit, as before."""
        shm, self._set_aside = self._set_aside, None
        if shm is None or shm not in _windows_to_close:
            return
        _windows_to_close.remove(shm)
        if not shm.close(timeout_s):
            _windows_to_close.append(shm)

    def start_timeline(self, path: str, mark_cycles: bool = False,
                       agree: Optional[Callable[[Optional[TimelineFailure]],
                                                Optional[TimelineFailure]]] = None) -> None:
        """Record a Chrome-trace timeline to `path` from now on (written by rank 0 only).

        As in Horovod, the file being recorded goes on (with `mark_cycles` from now) when `path`
        names it, and is closed when `path` names another. `agree` hands rank 0's failure to
        open `path` (None when it could) to every rank: a broadcast, called on every rank. When
        it failed, every rank raises TimelineError and recording goes on as before (without
        `agree`, rank 0 alone raises).
        """
        if self._timeline_owner is not None:  # one file per process: the global runtime's
            return self._timeline_owner.start_timeline(path, mark_cycles, agree)
        failure: Optional[TimelineFailure] = None
        opened: Optional[Timeline] = None
        current = self._own_timeline
        if self.rank == 0:
            if current is not None and current.writes_to(path):
                current.mark_cycles = mark_cycles
            else:
                try:
                    opened = Timeline(path, mark_cycles=mark_cycles)
                except OSError as exc:
                    failure = open_failure(exc, path, f"start_timeline({path!r})")
        if agree is not None:
            failure = agree(failure)
        if failure is not None:
            raise TimelineError(*failure)
        if opened is not None:
            self._own_timeline = opened
            if current is not None:
                current.close()

    def stop_timeline(self) -> None:
        """Stop recording and close the timeline file (no-op when none is recorded)."""
        if self._timeline_owner is not None:
            return self._timeline_owner.stop_timeline()
        old, self._own_timeline = self._own_timeline, None
        if old is not None:
            old.close()

    @property
    def _timeline(self) -> Optional["Timeline | LaneView"]:
        """Where this runtime's spans go now, or None when nothing records."""
        owner = self._timeline_owner
        if owner is None:
            return self._own_timeline
        shared = owner._own_timeline
        if shared is None:
            return None
        view = self._timeline_view
        if view is None or view.target is not shared:
            ranks = ",".join(map(str, self.global_ranks or []))
            view = self._timeline_view = LaneView(shared, f"[ranks {ranks}] ")
        return view

    def record_span(self, lane: str, phase: str, start: float, end: float,
                    args: Optional[dict] = None) -> None:
        """Add a phase measured outside the runtime (a caller-side compress or decompress)
        to the timeline, if one is being recorded; times are time.perf_counter() seconds."""
        timeline = self._timeline
        if timeline is not None:
            timeline.span(lane, phase, start, end, args)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ background side
    def _complete(self, request: Request, error: Optional[BaseException] = None) -> None:
        request.error = error
        with self._lock:
            if self._in_flight.get(request.name) is request:
                del self._in_flight[request.name]
                if request.spec.refused:
                    self._refusals -= 1
                    deferred = self._deferred_refusals.get(request.name)
                    if deferred:  # the name's next refusal goes now, before any retry of it
                        self._enqueue(deferred.popleft(), burst=False)
                        if not deferred:
                            del self._deferred_refusals[request.name]
            if request.spec.refused:  # nobody waits for a refusal's handle
                self._handles.pop(request.handle, None)
        request.done.set()

    def _withdraw_group(self, failed: Request, message: str, outcome) -> None:
        """A member of a group failed negotiation: its siblings still waiting here fail with
        it (the caller's one handle has failed), unless agreed this cycle, which every rank
        then runs. Ranks that grouped differently withdraw theirs alike: each saw the error."""
        group = failed.group_place[0]
        agreed = {item.name for item in outcome.ready}
        siblings = [name for name, request in self._pending.items()
                    if request.group_place is not None and request.group_place[0] == group
                    and name not in agreed and name not in outcome.errors]
        for name in siblings:
            self._complete(self._pending.pop(name), TensorMismatchError(
                f"{message} (withdrawn with the rest of its group)"))

    def _fail_everything(self, error: BaseException) -> None:
        with self._lock:
            self._failure = error
            self._queue = []
            self._refusals -= sum(len(d) for d in self._deferred_refusals.values())
            self._deferred_refusals.clear()
            unfinished = list(self._in_flight.values())
        self._scheduler.reset()
        self._pending.clear()
        for request in unfinished:
            self._complete(request, error)

    def _loop(self) -> None:
        cycle_s = self.config.cycle_time_ms / 1000.0
        try:
            while True:
                started = time.monotonic()
                with self._lock:
                    if (self._burst_since is not None and not self._start_now
                            and started < self._burst_since + self._burst_window_s):
                        new = []  # a round on a peer's behalf: the held burst stays queued
                    else:
                        new, self._queue = self._queue, []
                        self._burst_since, self._burst_bytes, self._start_now = None, 0, False
                    shutdown = self._shutdown_requested
                    waiting = self._waiters > 0
                for request in new:
                    if request.spec.kind == "join":
                        self._join_request = request
                    else:
                        self._pending[request.name] = request
                # Vote to release incomplete groups only when blocked with nothing of ours
                # still to negotiate: then no further member can arrive from this rank. (A
                # refusal waits only for the others to submit its name.)
                flush = waiting and all(r.spec.refused for r in self._pending.values())
                stall_check = self._stall_check_due(started)
                outcome = self._negotiator.cycle(
                    [(r.name, r.spec, started - r.submitted_at) for r in self._pending.values()],
                    flush=flush, shutdown=(self._shutdown_reason or True) if shutdown else False,
                    stall_check=stall_check,
                    joined=self._join_request is not None, idle=not self._scheduler.pending,
                    reduce=self._in_round() if self._reduce_in_round else None)
                self.stats.cycles = self._negotiator.cycles
                self.stats.full_exchanges = self._negotiator.full_exchanges
                if outcome.shutdown_ranks:
                    others = [r if self.global_ranks is None else self.global_ranks[r]
                              for r in outcome.shutdown_ranks if r != self.rank]
                    if outcome.shutdown_reason:
                        reason = outcome.shutdown_reason
                    elif not others:
                        reason = "fusionring has been shut down"
                    else:
                        reason = (f"fusionring has been shut down because rank(s) "
                                  f"{', '.join(map(str, others))} shut down (finished, or "
                                  f"failed with an exception); operations still pending "
                                  f"cannot complete")
                    self._fail_everything(FusionRingError(reason))
                    return
                if outcome.stall_warning and self.rank == 0:
                    # As Horovod: once every warning time, though the check runs twice as
                    # often (so a shutdown limit is met on time).
                    now = time.monotonic()
                    warn_s = self.config.stall_warning_s or 0.0
                    if (self._last_stall_warning is None
                            or now - self._last_stall_warning >= warn_s * 0.999):
                        self._last_stall_warning = now
                        print(outcome.stall_warning, file=sys.stderr, flush=True)
                if outcome.abort:
                    # The stalled rank may never reach MPI_Finalize, which would then hold this
                    # one at exit with the launcher none the wiser: leave without it, failed.
                    exit_nonzero_without_finalize()
                    self._fail_everything(StallError(outcome.abort))
                    return
                for name, message in outcome.errors.items():
                    if name in self._pending:  # a joined rank has no request of its own
                        failed = self._pending.pop(name)
                        self._complete(failed, TensorMismatchError(message))
                        if failed.group_place is not None:
                            self._withdraw_group(failed, message, outcome)
                ready = []
                for item in outcome.ready:
                    request = self._pending.pop(item.name, None)
                    if request is None:
                        request = self._stand_in(item)
                    request.ready_info = item
                    ready.append(request)
                ready = _in_group_order(ready)
                timeline = self._timeline  # start/stop_timeline may swap it meanwhile
                if timeline is not None:
                    timeline.mark_cycle()
                    now = time.perf_counter()
                    for request in ready:
                        waited = time.monotonic() - request.submitted_at
                        timeline.span(request.name, "negotiate", now - waited, now,
                                      kind=request.spec.kind)
                try:
                    if outcome.reduced:
                        self._reduced_in_round(ready)
                    else:
                        self._execute(ready, outcome.flush)
                    if ready and timeline is not None:
                        timeline.flush()
                except Exception as exc:  # noqa: BLE001 - peers must hear of it, not hang
                    self._abort_after_agreement(ready, exc)
                    return
                if outcome.join_done and self._join_request is not None:
                    self._join_request.payload = outcome.last_joined
                    self._complete(self._join_request)
                    self._join_request = None
                held = bool(self._pending or self._scheduler.pending)
                busy = held or bool(ready)
                self._quiet_cycles = 0 if busy else self._quiet_cycles + 1
                # With nothing in flight anywhere (at this cycle's start, or once its ready
                # tensors are done), the next cycle starts from a submission (or after a
                # long wait): the others join it once they submit too, and no tensor could
                # be agreed before then anyway.
                everyone_idle = ((outcome.all_idle or outcome.settled) and not held
                                 and self._join_request is None)
                # Likewise with nothing of ours in flight and no caller of ours blocked, even
                # while a peer waits for us: what it waits for is our submission, and that
                # starts our next cycle at once. Cycling on a timer meanwhile only made every
                # rank pay a round per millisecond for as long as the late rank took.
                nothing_here = (not held and not ready and self._join_request is None
                                and not self._caller_waiting())
                if ready or not self._pending:
                    self._eager_since = None
                elif self._caller_waiting():
                    # A caller is blocked on tensors some rank has not submitted yet: the
                    # next round waits for that rank's submission inside the collective,
                    # so sleeping out the cycle here would only add to its latency. Only for
                    # a while: ranks stuck on different tensors would otherwise spin rounds.
                    now = time.monotonic()
                    if self._eager_since is None:
                        self._eager_since = now
                    if now - self._eager_since < _EAGER_ROUNDS_S:
                        continue
                self._idle(started, _ALL_IDLE_WAIT_S if everyone_idle or nothing_here
                           else cycle_s)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear about it
            self._fail_everything(FusionRingError(f"fusionring background loop failed on rank "
                                                  f"{self.rank}: {exc}"))

    def _abort_after_agreement(self, ready: List[Request], exc: BaseException) -> None:
        """This rank failed inside operations every rank had agreed to run. Its caller gets
        the error and the peers a shutdown notice naming this rank. A peer already inside
        the data collective this rank will not enter cannot take the notice, and that
        collective cannot be cancelled: if the notice is not taken in time, the error is
        printed and the job aborted rather than left hanging."""
        names = ", ".join(display_name(r.name) for r in ready[:4])
        names += " ..." if len(ready) > 4 else ""
        message = (f"fusionring background loop failed on rank {self.rank} in {names}: "
                   f"{type(exc).__name__}: {exc}")
        self._fail_everything(FusionRingError(message))
        if self.size == 1:
            return
        taken = threading.Event()

        def farewell() -> None:
            self._farewell()
            taken.set()

        # A caller that ends its script meanwhile must not finalize MPI (which waits for the
        # peers) before this decides: shutdown() waits for it.
        self._farewell_pending = True
        threading.Thread(target=farewell, name="fusionring-farewell", daemon=True).start()
        if taken.wait(_FAREWELL_WAIT_S):
            self._farewell_pending = False
            return
        print(f"{message}\n{''.join(traceback.format_exception(exc))}"
              f"fusionring: the other ranks are inside these operations and cannot be told; "
              f"aborting the job", file=sys.stderr, flush=True)
        unlink_mpi_shared_memory()
        self._MPI.COMM_WORLD.Abort(1)

    def _farewell(self) -> None:
        """One last cycle that raises the shutdown flag, so peers fail their pending
        operations naming this rank instead of waiting for it."""
        try:
            self._negotiator.cycle([], flush=False, shutdown=True, stall_check=False,
                                   joined=False, idle=True)
        except Exception:  # noqa: BLE001 - the error itself has been reported already
            pass

    def _stand_in(self, item: Ready) -> Request:
        """This joined rank's part in an operation it never submitted: zeros to reduce (or
        nothing, for a barrier)."""
        spec = item.spec
        if self._join_request is None or spec is None:
            raise FusionRingError(f"'{item.name}' was agreed ready but this rank never "
                                  f"submitted it")
        dtype = getattr(torch, spec.dtype, torch.uint8)
        # Zeros where the peers' tensors lie: a GPU batch goes over NCCL, which this rank
        # joins from the GPU it reduces on (torch's current device before its first batch).
        device = ((self._nccl.device if self._nccl is not None and self._nccl.device else "cuda")
                  if spec.device else "cpu")
        tensor = torch.zeros(spec.shape, dtype=dtype, device=device)
        if spec.kind == "allreduce":
            tensor = real_view(tensor)
        request = Request(item.name, spec, tensor, tensor, root=spec.root,
                          submitted_at=time.monotonic(),
                          # the zeros are written on the current stream, the NCCL one reads
                          ready_event=ready_event(tensor) if tensor.is_cuda else None)
        if spec.kind == "allreduce":
            request.core_op, request.prescale, request.postscale = core_reduction(
                ReduceOp[spec.op], spec.prescale, spec.postscale, self.size)
        return request

    def _caller_waiting(self) -> bool:
        with self._lock:
            return self._waiters > 0

    def _stall_check_due(self, now: float) -> bool:
        warn = self.config.stall_warning_s
        limits = [s for s in (warn, self.config.stall_shutdown_s) if s is not None]
        if not limits or not self._pending:
            return False
        interval = min(limits) / 2
        if now - self._last_stall_check < interval:
            return False
        oldest = now - next(iter(self._pending.values())).submitted_at
        if oldest < min(limits):
            return False
        self._last_stall_check = now
        return True

    def _idle(self, started: float, cycle_s: float) -> None:
        # After a quiet spell, cycle less often: idle ranks otherwise spin in MPI waiting
        # for each other and take CPU from training. A submission wakes the loop at once.
        if self._quiet_cycles > _QUIET_CYCLES_BEFORE_BACKOFF:
            cycle_s = max(cycle_s, self.config.cycle_time_ms / 1000.0 * _QUIET_BACKOFF)
        with self._lock:
            self._poked = False
            try:
                while not (self._start_now or self._poked or self._shutdown_requested):
                    deadline = started + cycle_s
                    if self._burst_since is not None:
                        deadline = min(deadline, self._burst_since + self._burst_window_s)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._idle_until = deadline
                    self._wakeup.wait(remaining)
            finally:
                self._idle_until = None

    # ------------------------------------------------------------------ execution
    def _in_round(self) -> Optional[Callable[[int, int], bool]]:
        """The round's AND together with the reduction of every pending tensor, when they
        would make exactly one fused batch through the window (else None: the round only
        negotiates). The batch is laid out in cache-id order, the order the round makes
        them ready, so every rank that offers the same tensors lays them out alike."""
        pending = list(self._pending.values())
        if not pending or self._scheduler.groups or self._scheduler.pending:
            return None
        first = pending[0]
        total = 0
        for r in pending:
            if (r.spec.kind != "allreduce" or r.communicator is not None or r.spec.compression
                    or r.tensor.is_cuda
                    or r.core_op == ADASUM_CODE or r.core_op != first.core_op
                    or r.spec.dtype != first.spec.dtype or r.prescale != first.prescale
                    or r.postscale != first.postscale):
                return None
            total += r.nbytes
        if not self._scheduler.one_batch(total, len(pending)):
            return None
        # Any size that fits the slot: small batches too, which would otherwise take an MPI
        # allreduce of their own, since the round waits on the window anyway.
        order = self._negotiator.cached_order([(r.name, r.spec) for r in pending])
        if order is None:
            return None
        words_bytes = -(-8 * self._negotiator.round_words() // 64) * 64
        if words_bytes + total > self._shm.slot_bytes:
            return None
        ordered = [pending[i] for i in order]
        return functools.partial(self._shm_op.with_round, ordered)

    def _reduced_in_round(self, ready: List[Request]) -> None:
        """Book a batch the round reduced itself, as _execute would have run it."""
        self._scheduler.count_batch(sum(r.nbytes for r in ready), len(ready))
        self._shm_op.count_round(ready)
        self.stats.batches_in_round += 1
        self._complete_all(ready)

    def _execute(self, ready: List[Request], flush: bool) -> None:
        for request in ready:
            if request.spec.kind == "fusion_groups":
                self._guarded([request], self._install_groups)
        reductions = [Entry(name=r.name, nbytes=r.nbytes,
                            fusion_key=(r.spec.dtype, r.core_op, r.prescale, r.postscale,
                                        r.spec.compression, r.spec.device),
                            payload=r)
                      for r in ready if r.spec.kind == "allreduce" and r.core_op != ADASUM_CODE]
        if reductions or flush:
            for batch in self._scheduler.schedule(reductions, flush=flush):
                run = functools.partial(self._allreduce_ops.execute, kind=batch.kind)
                for part in self._transfers(batch):
                    self._guarded(part, run)
        fused = set()
        for part in self._allgather_batches(ready):
            self._guarded(part, self._mpi.allgather_fused)
            fused.update(id(r) for r in part)
        for request in ready:
            if id(request) in fused:
                continue
            run = self._collectives.get(request.spec.kind)
            if request.spec.kind == "allreduce" and request.core_op == ADASUM_CODE:
                # per tensor: its coefficients come from its own norms
                run = (self._gpu_collectives["adasum"] if request.tensor.is_cuda
                       else self._mpi.adasum)
            elif run is not None and request.tensor is not None and request.tensor.is_cuda:
                run = self._gpu_collectives[request.spec.kind]  # a CUDA tensor, over NCCL
            if run is not None:
                self._guarded([request], run)

    def _allgather_batches(self, ready: List[Request]) -> List[List[Request]]:
        """The host allgathers of a cycle gathered under pack_limit_bytes each (all ranks'
        rows), in batches of up to the fusion threshold, to run as one collective each. Every
        rank knows every rank's rows, so every rank forms the same batches."""
        limit = self.config.pack_limit_bytes
        batches: List[List[Request]] = []
        total = 0
        for request in ready:
            if request.spec.kind != "allgather" or request.spec.device:
                continue
            nbytes = (sum(request.ready_info.first_dims) * request.tensor.element_size()
                      * math.prod(request.tensor.shape[1:]))
            if 0 < limit <= nbytes:   # as for reductions, 0 packs everything
                continue
            if not batches or total + nbytes > self.config.fusion_threshold_bytes:
                batches.append([])
                total = 0
            batches[-1].append(request)
            total += nbytes
        return batches

    def _transfers(self, batch: FusedBatch) -> List[List[Request]]:
        """The collectives that carry one scheduled batch, the same on every rank.

        A threshold batch goes through the fusion buffer, so its tensors of at least
        pack_limit_bytes are reduced on their own where they lie instead: copying them in and
        out costs more than the collective it saves. Plan groups lie in one buffer already, and
        compressors and the shared-memory window read the tensors where they lie, so those
        batches stay whole. Only sizes and settings decide, never addresses: every rank splits
        alike.
        """
        requests = [e.payload for e in batch.entries]
        limit = self.config.pack_limit_bytes
        if (batch.kind != THRESHOLD or limit <= 0 or requests[0].communicator is not None
                or requests[0].tensor.is_cuda  # a GPU packs at memory speed: one collective
                or self._through_shared_memory(requests, batch.kind)):
            return [requests]
        small = [r for r in requests if r.nbytes < limit]
        large = [[r] for r in requests if r.nbytes >= limit]
        return ([small] if small else []) + large

    def _guarded(self, requests: List[Request], run) -> None:
        started = time.perf_counter()
        try:
            run(requests)
        except ValueError as exc:
            for request in requests:
                self._complete(request, exc)
            return
        timeline = self._timeline
        kind = requests[0].spec.kind
        if timeline is not None and kind != "fusion_groups":
            # The whole processing, around the phases the collective recorded itself.
            timeline.span(lane(requests), "operation", started, time.perf_counter(),
                          {"tensors": len(requests)}, kind=kind)
        self._complete_all(requests)

    def _complete_all(self, requests: List[Request]) -> None:
        """_complete() for a batch that succeeded, under one acquisition of the lock."""
        with self._lock:
            in_flight = self._in_flight
            for request in requests:
                request.error = None
                if in_flight.get(request.name) is request:
                    del in_flight[request.name]
        for request in requests:
            request.done.set()

    def _install_groups(self, requests: List[Request]) -> None:
        # Whatever the old plan still holds is reduced first, identically on every rank.
        for batch in self._scheduler.schedule([], flush=True):
            self._guarded([e.payload for e in batch.entries],
                          functools.partial(self._allreduce_ops.execute, kind=batch.kind))
        label, groups = requests[0].payload
        group_sets = {k: v for k, v in self._group_sets.items() if k != label}
        if groups:
            group_sets[label] = groups  # the newest last: its names win
        # Built before it is kept: groups that overlap themselves raise here and change nothing.
        self._scheduler = FusionScheduler(_merge_group_sets(group_sets),
                                          self.config.fusion_threshold_bytes)
        self._group_sets = group_sets

    @property
    def scheduler(self) -> FusionScheduler:
        return self._scheduler

    def _through_shared_memory(self, requests: List[Request], kind: str) -> bool:
        """Whether this batch goes through the shared-memory window rather than the ring."""
        return self._shm_op.enabled(requests, kind)


def _in_group_order(ready: List[Request]) -> List[Request]:
    """`ready` with the compressed members of each grouped submission in the order given,
    at the place of the group's first member; everything else stays where it was.

    Ready tensors come in the order their names were first negotiated, which a new job (a
    resumed one) meets afresh. A compressor with per-rank masks (or samples) depends on the
    fused layout, so a group's layout must not: every rank submits the group's names in the
    same order, so every rank lays it out alike. Only compressed requests are moved, and a
    compressed operation has a request on every rank (no joined rank's stand-in)."""
    if not any(r.group_place is not None and r.spec.compression for r in ready):
        return ready
    anchor: Dict[int, int] = {}
    keys = []
    for position, request in enumerate(ready):
        if request.group_place is not None and request.spec.compression:
            group, place = request.group_place
            keys.append((anchor.setdefault(group, position), place))
        else:
            keys.append((position, -1))
    return [request for _, request in sorted(zip(keys, ready), key=lambda pair: pair[0])]


def _merge_group_sets(group_sets: Dict[str, List[List[str]]]) -> Optional[List[List[str]]]:
    """Every label's groups as one list; a name grouped by a later label leaves earlier ones."""
    claimed = set()
    merged: List[List[str]] = []
    for groups in reversed(list(group_sets.values())):
        kept = [[n for n in group if n not in claimed] for group in groups]
        for group in groups:
            claimed.update(group)
        merged[:0] = [group for group in kept if group]
    return merged or None


def close_shared_memory() -> None:
    """Free the shared-memory windows of runtimes that have shut down, in the order they shut
    down (the same on every rank: process sets first, then the global runtime). Collective:
    every rank calls it at exit. A window whose peers have gone, or do not arrive within a
    minute, is left to MPI_Finalize."""
    while _windows_to_close:
        _windows_to_close.pop(0).close(_SHM_CLOSE_WAIT_S)
