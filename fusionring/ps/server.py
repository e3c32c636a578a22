"""The server role: hold a shard of the parameters, apply the pushes the sync policy lets through, answer workers.

A server polls MPI for worker messages (``Iprobe``, so a worker that sends nothing, not even the heartbeat its
process sends while it lives, becomes an error after the stall timeout rather than a hang), feeds each arrival to
the policy of ``sync.py``, runs the optimizer steps the policy's decision lists and sends the new parameters to the
workers it names. Everything it does is a function of the order in which
messages arrive.

Optimizer: in every mode the server builds the wrapped optimizer's own class with the workers' param-group
hyper-parameters, so momentum, Adam or weight decay act as they would locally. Before each optimizer step it sets
the numeric hyper-parameters (lr, momentum, betas, weight_decay, ...) of the push that completed the update, so a
worker's LR scheduler steers the server. Under asp, ssp and adaptive the optimizer's state (momentum buffer,
Adam's moments) is one state fed by every worker's gradients in arrival order, each computed on the parameters
that worker last pulled: see docs/ps.md for what that means for momentum.
"""
from __future__ import annotations

import io
import os
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Set

import numpy as np
import torch

from ..config import settings
from ..exceptions import FusionRingError, StallError, TensorMismatchError
from ..process_exit import exit_nonzero_without_finalize
from . import payload, protocol
from .protocol import Header
from .sync import Decision, make_policy


def _number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    # torch's optimizers take a one-value tensor lr (and betas); LR schedulers fill it in place
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool


def numeric_hyper(value: Any) -> bool:
    """A hyper-parameter a push may change on the server: a number or one-value tensor, or a tuple of them (Adam's
    betas)."""
    if isinstance(value, tuple):
        return all(_number(v) for v in value)
    return _number(value)


def _warn_on_differing_hyper(hellos: Dict[int, dict]) -> None:
    """Workers whose optimizers start with other hyper-parameters than worker 0's are allowed (the server
    follows the pushes), but a typo there would otherwise show only as a model that trains oddly."""
    first, *others = sorted(hellos)
    differing = []
    for k in others:
        for index, (mine, theirs) in enumerate(zip(hellos[k]["groups"], hellos[first]["groups"])):
            keys = sorted(key for key, value in mine["hyper"].items()
                          if numeric_hyper(value) and repr(value) != repr(theirs["hyper"].get(key)))
            differing += [f"worker {k} group {index} {key}={mine['hyper'][key]!r} "
                          f"(worker {first}: {theirs['hyper'].get(key)!r})" for key in keys]
    if differing:
        warnings.warn("fusionring.ps: the workers' optimizers have different hyper-parameters: "
                      + "; ".join(differing) + ". The server steps with those of the push that completes each "
                      "update (under bsp, the round's highest-numbered worker's)", RuntimeWarning, stacklevel=2)


def set_hyper(group: dict, hyper: dict) -> None:
    """Copy a push's numeric hyper-parameters into an optimizer param group (keys the group already has)."""
    for key, value in hyper.items():
        if key == "params" or key not in group or not numeric_hyper(value):
            continue
        current = group[key]
        if isinstance(current, torch.Tensor) and not isinstance(value, tuple):
            # in place, as torch's LR schedulers update a tensor lr: the optimizer keeps its own tensor
            current.fill_(value.item() if isinstance(value, torch.Tensor) else value)
        else:
            group[key] = value


def weighted_sum(grads: List[torch.Tensor], weights: List[float], dtype: torch.dtype) -> torch.Tensor:
    """``sum(w * g)`` in list order, the one way the server (and a replay) combines an update's gradients."""
    if len(grads) == 1 and weights[0] == 1.0:
        return grads[0].to(dtype)
    # (w * g) rounded, then added: the plain definition, not a fused multiply-add, so a replay in one process
    # (or a reference in numpy) reproduces it bit for bit
    total = None
    for g, w in zip(grads, weights):
        term = g.to(dtype) * w
        total = term if total is None else total.add_(term)
    return total


class Server:
    """One server rank's loop. ``run()`` returns once every worker has shut down; it raises on a fault after
    telling every worker still there what happened."""

    def __init__(self, comm: Any, num_servers: int) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.num_servers = num_servers
        self.num_workers = comm.Get_size() - num_servers
        self.timeout = protocol.timeout_s()    # None: no limit
        self.interval = protocol.heartbeat_interval(self.timeout)
        self.nap = settings().ps_poll_sleep_us / 1e6
        self.active = set(range(self.num_workers))
        self.held: set = set()                 # workers waiting on a reply the policy holds back
        self.owed: set = set()                 # workers waiting on a reply at all (held, starting, loading)
        self.beating: set = set()              # workers whose heartbeat arrived
        now = time.monotonic()
        self.last_heard = {k: now for k in range(self.num_workers)}
        self.last_push = {k: now for k in range(self.num_workers)}
        self.warned: set = set()               # workers named in a wait warning since their last push
        self.next_check = 0.0
        self.next_beat = 0.0
        self.absent: Dict[int, frozenset] = {}  # per worker: the parameters its pending push has no gradient for
        self.started: set = set()              # workers that pushed in this job (a load_state_dict() after is late)
        self.buffer_names: List[str] = []       # server 0: worker 0's buffers (running statistics), if it sent any
        self.buffers: Dict[str, torch.Tensor] = {}
        self.grads: Dict[int, Dict[str, torch.Tensor]] = {}
        self.hyper: Dict[int, List[dict]] = {}
        self.pushes = {k: 0 for k in range(self.num_workers)}
        self.epochs = {k: 0 for k in range(self.num_workers)}
        self.sent_version = {k: 0 for k in range(self.num_workers)}
        self.staleness = {k: 0 for k in range(self.num_workers)}
        self.version = 0
        self.changes: List[dict] = []
        self.requests: List[Any] = []
        self.loading: Dict[int, Any] = {}      # workers that sent load_state_dict(), worker 0's state
        self.timeline = None
        self.record: Optional[dict] = None
        self.bytes_received = 0
        self.bytes_sent = 0
        self.push_buffers: Dict[int, np.ndarray] = {}
        self.param_sends: List[tuple] = []     # (request, worker): parameters sent from their own memory
        self.last_any_push = now
        self.push_gap: Optional[float] = None  # a running mean of the time between pushes

    # ------------------------------------------------------------------ messaging
    def _worker_rank(self, k: int) -> int:
        return self.num_servers + k

    def _send(self, k: int, header: Header, data: Optional[np.ndarray] = None) -> None:
        dest = self._worker_rank(k)
        self.requests.append(self.comm.isend(header, dest=dest, tag=protocol.TAG_TO_WORKER))
        if data is not None:
            self.requests.append(self.comm.Isend(data, dest=dest, tag=protocol.TAG_TO_WORKER_DATA))
            self.bytes_sent += data.size
        if len(self.requests) > 64:
            self.requests = [r for r in self.requests if not r.Test()]

    def _fail(self, error: Exception) -> None:
        """Tell every worker still there, then raise ``error`` (the process will exit with status 1)."""
        exit_nonzero_without_finalize()
        for k in sorted(self.active):
            try:
                self._send(k, Header(protocol.ERROR, {"message": f"server rank {self.rank}: {error}",
                                                      "type": type(error).__name__}))
            except Exception:  # a dead peer must not hide the original error
                pass
        deadline = time.monotonic() + 2.0  # let the errors leave before this process exits
        while self.requests and time.monotonic() < deadline:
            self.requests = [r for r in self.requests if not r.Test()]
            time.sleep(0.01)
        raise error

    def _receive(self, status: Any) -> tuple:
        """The next worker header (blocks only once Iprobe found one) and its data buffer, if any."""
        source = status.Get_source()
        header: Header = self.comm.recv(source=source, tag=protocol.TAG_TO_SERVER)
        data = None
        nbytes = header.fields.get("nbytes")
        k = source - self.num_servers
        if nbytes is not None and header.kind == protocol.PUSH:
            # one buffer per worker, reused: the decoded gradients are views into it, and a worker pushes again
            # only after its reply, which comes after its gradient was applied
            data = self.push_buffers.get(k)
            if data is None or data.size != nbytes:
                data = self.push_buffers[k] = np.empty(nbytes, dtype=np.uint8)
            payload.recv_parts(self.comm, data, payload.part_sizes(header.fields["layout"]), source,
                               protocol.TAG_TO_SERVER_DATA)
            self.bytes_received += nbytes
            if header.fields.get("buffers"):  # worker 0's buffers follow its gradients, as one message
                raw = np.empty(header.fields["buffers"], dtype=np.uint8)
                self.comm.Recv(raw, source=source, tag=protocol.TAG_TO_SERVER_DATA)
                self.bytes_received += raw.size
                # replies carry a copy of the buffers (_param_parts), so they may change while those are sent
                payload.unpack_into(raw, [self.buffers[n] for n in self.buffer_names])
        elif nbytes is not None:
            data = np.empty(nbytes, dtype=np.uint8)
            self.comm.Recv(data, source=source, tag=protocol.TAG_TO_SERVER_DATA)
            self.bytes_received += nbytes
        self.last_heard[k] = time.monotonic()
        if header.kind == protocol.HEARTBEAT:
            self.beating.add(k)
        return k, header, data

    def _next_message(self, waiting_for_hello: bool = False) -> tuple:
        """Poll for the next header (a heartbeat is one); meanwhile send the waiting workers this server's
        heartbeat, and fail on a worker silent past the limit (no header, not even a heartbeat: it is dead)."""
        from mpi4py import MPI
        status = MPI.Status()
        spins = 0
        # before the first hello, workers are still importing and building their models: allow the longer of
        # the two limits; once training runs, the stall limit applies
        limit = protocol.longest(self.timeout, settings().ps_timeout_s) if waiting_for_hello else self.timeout
        while True:
            if spins % 64 == 0:  # on entry too, so a server busy with messages still judges silence
                now = time.monotonic()
                if now >= self.next_check:
                    self.next_check = now + self.interval / 2
                    if now >= self.next_beat:
                        self.next_beat = now + self.interval
                        self._send_heartbeats()
                    self._check_silence(limit, waiting_for_hello)
                    self._warn_waits()
                if spins and self.nap > 0:
                    time.sleep(self.nap)
                if self._quiet_spell():
                    return -1, Header(_UNBLOCK), None
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_TO_SERVER, status=status):
                return self._receive(status)
            spins += 1

    def _quiet_spell(self) -> bool:
        """Whether to aggregate the adaptive mode's list without waiting for more pushes. With several servers,
        each runs the rule on its own arrival order, so around a group change server A's list can wait for a
        worker that server B holds while B's waits for one A holds; the slack counter moves only with further
        pushes, and there may be none (the asynchronous workers slow or gone). So a server of several aggregates
        its list after no push at all came for four times the usual gap between pushes (at least 0.5 s)."""
        if self.num_servers == 1 or not getattr(getattr(self, "policy", None), "list", None):
            return False
        usual = self.push_gap if self.push_gap is not None else 0.0
        return time.monotonic() - self.last_any_push > max(_QUIET_MIN_S, 4 * usual)

    def _send_heartbeats(self) -> None:
        """A worker waiting on this server (held back by the sync rule, or waiting for the others to start or
        load) hears from it every few seconds, so it waits as long as the server lives."""
        for k in sorted(self.owed & self.active):
            self._send(k, Header(protocol.HEARTBEAT))

    def _check_silence(self, limit: Optional[float], waiting_for_hello: bool) -> None:
        """Fail on a worker that sent nothing, not even its heartbeat, for ``limit`` seconds. A worker without a
        heartbeat (MPI below MPI_THREAD_MULTIPLE) is judged only while this server owes it nothing."""
        if limit is None:
            return
        now = time.monotonic()
        judged = [k for k in self.active if k in self.beating or k not in self.owed]
        # longest silent first: the worker that died, not the ones blocked behind it
        silent = sorted((k for k in judged if now - self.last_heard[k] > limit),
                        key=lambda k: (self.last_heard[k], k))
        if not silent:
            return
        k = silent[0]
        what = "sent no model description" if waiting_for_hello else "sent nothing"
        why = ("not even its heartbeat: its process died, exited without ps.shutdown(), or is frozen"
               if k in self.beating else "it died or exited without ps.shutdown()")
        self._fail(StallError(
            f"worker {k} (rank {self._worker_rank(k)}) {what} for {limit:g} s, {why} (silent workers: "
            f"{sorted(silent)}; limit: FUSIONRING_STALL_SHUTDOWN_S or FUSIONRING_PS_TIMEOUT_S)"))

    def _warn_waits(self) -> None:
        """Name, once per wait, a live worker that others have been held back for longer than the stall warning
        time: waiting is what bsp and ssp do, so it is no error, but a long one deserves a word."""
        warn = settings().stall_warning_s
        if warn is None or not self.held:
            return
        now = time.monotonic()
        for k in sorted(self.active - self.owed - self.warned):
            if now - self.last_push[k] > warn:
                self.warned.add(k)
                print(f"fusionring.ps server rank {self.rank}: workers {sorted(self.held)} wait for worker {k} "
                      f"(rank {self._worker_rank(k)}), alive but without a push for {now - self.last_push[k]:.0f}"
                      f" s (evaluation, a checkpoint, a slow data loader?); they go on waiting", file=sys.stderr,
                      flush=True)

    # ------------------------------------------------------------------ start
    def _start(self) -> bool:
        """Every worker's hello: check the models agree with worker 0's, build parameters and optimizer.

        False when every worker shut down without building a ps.DistributedOptimizer: nothing to serve."""
        hellos: Dict[int, dict] = {}
        gone: Set[int] = set()
        values = None
        while len(hellos) + len(gone) < self.num_workers:
            k, header, data = self._next_message(waiting_for_hello=True)
            if header.kind == protocol.HEARTBEAT:
                continue
            if header.kind == protocol.FAILED:
                self._fail(_ERROR_TYPES.get(header.fields.get("type"), FusionRingError)(
                    header.fields["message"]))
            if header.kind == protocol.BYE:
                gone.add(k)
                continue
            if header.kind != protocol.HELLO:
                self._fail(FusionRingError(f"worker {k} sent {header.kind!r} before its model description"))
            hellos[k] = header.fields
            self.owed.add(k)  # it waits for the others' hellos: this server's heartbeat tells it the server lives
            if k == 0:
                values = data
        if not hellos:
            return False  # a job that built no optimizer (ps.init(), then ps.shutdown()) ends cleanly
        if gone:
            self._fail(FusionRingError(
                f"worker{'s' if len(gone) > 1 else ''} {', '.join(map(str, sorted(gone)))} called ps.shutdown() "
                f"before building ps.DistributedOptimizer, while worker{'s' if len(hellos) > 1 else ''} "
                f"{', '.join(map(str, sorted(hellos)))} built one: every worker builds it, or none"))
        self._check_record_path()  # once every worker waits for the answer, so each gets the error at once
        ref = hellos[0]
        for k in range(1, self.num_workers):
            problem = protocol.model_mismatch(ref["model"], hellos[k]["model"], k)
            if problem is not None:
                self._fail(TensorMismatchError(f"the workers' models differ: {problem}"))
            problem = protocol.model_mismatch(ref.get("buffers", []), hellos[k].get("buffers", []), k, "buffer")
            if problem is not None:
                self._fail(TensorMismatchError(f"the workers' buffers differ (named_buffers=): {problem}"))
            for key in ("sync", "staleness", "slack", "optimizer"):
                if hellos[k][key] != ref[key]:
                    self._fail(ValueError(f"{key}: worker 0 has {ref[key]!r}, worker {k} has {hellos[k][key]!r}"))
        if self.rank == 0:
            _warn_on_differing_hyper(hellos)
        self.sync = ref["sync"]
        self.policy = make_policy(ref["sync"], self.num_workers, ref["staleness"], ref["slack"])
        model = ref["model"]
        names = [n for n, _, _ in model]
        nbytes = [int(np.prod(s)) * torch.empty((), dtype=_dtype(d)).element_size() for _, s, d in model]
        self.names = protocol.shard_names(names, nbytes, self.num_servers)[self.rank]
        shapes = {n: (s, d) for n, s, d in model}
        self.params: Dict[str, torch.Tensor] = {
            n: torch.empty(shapes[n][0], dtype=_dtype(shapes[n][1])) for n in self.names}
        # worker 0's buffers, which only its hello to server 0 describes, follow its parameters
        self.buffer_names = [n for n, _, _ in ref.get("buffers", [])]
        self.buffers = {n: torch.empty(shape, dtype=payload.tensor_dtype(d)) for n, shape, d in ref.get("buffers", [])}
        payload.unpack_into(values, [self.params[n] for n in self.names] + self._buffer_list())
        self.decoders = {k: payload.build_decoder(h["decoder"]) for k, h in hellos.items()}
        self.optimizer = self._build_optimizer(ref["optimizer"], ref["groups"])
        if settings().timeline_path:
            from ..timeline import Timeline
            self.timeline = Timeline(f"{settings().timeline_path}.ps{self.rank}")
        if settings().ps_record_path:
            self.record = {"names": list(self.names), "sync": ref["sync"], "staleness": ref["staleness"],
                           "slack": ref["slack"], "num_workers": self.num_workers, "optimizer": ref["optimizer"],
                           "groups": ref["groups"], "initial": {n: t.clone() for n, t in self.params.items()},
                           "events": []}
        parts = self._param_parts()
        for k in range(self.num_workers):
            self._reply(k, parts)
        return True

    def _build_optimizer(self, optimizer_class: type, groups: List[dict]) -> Optional[torch.optim.Optimizer]:
        own = set(self.names)
        self.group_names: List[List[str]] = []
        built = []
        for g in groups:
            mine = [n for n in g["names"] if n in own]
            if not mine:
                continue
            built.append({"params": [self.params[n] for n in mine], **g["hyper"]})
            self.group_names.append(mine)
        self.group_index = [i for i, g in enumerate(groups) if any(n in own for n in g["names"])]
        if not built:  # more servers than parameters: this one holds none
            return None
        try:
            return optimizer_class(built)
        except Exception as e:  # an optimizer that cannot be rebuilt from its param groups
            self._fail(ValueError(f"optimizer: the server cannot build {optimizer_class.__name__} from the "
                                  f"workers' param groups: {e}"))

    def _check_record_path(self) -> None:
        """FUSIONRING_PS_RECORD's file is written at the end of the job: a path it cannot be written to fails the
        job now, not after training."""
        path = settings().ps_record_path
        if not path:
            return
        target = f"{path}.server{self.rank}"
        existed = os.path.exists(target)
        try:
            with open(target, "ab"):
                pass
            if not existed:
                os.remove(target)
            return
        except OSError as e:
            problem = e
        self._fail(FusionRingError(f"FUSIONRING_PS_RECORD={path!r}: server rank {self.rank} cannot write its "
                                   f"record to {target}: {problem}"))

    # ------------------------------------------------------------------ updates and replies
    def _buffer_list(self) -> List[torch.Tensor]:
        return [self.buffers[n] for n in self.buffer_names]

    def _param_parts(self) -> List[np.ndarray]:
        """What a reply carries: the shard's parameters, each from its own memory, and on server 0 a copy of
        worker 0's buffers (one part), which the next push of worker 0 may change while the reply is sent."""
        parts = payload.dense_parts([self.params[n] for n in self.names])
        if self.buffer_names:
            parts.append(payload.pack(self._buffer_list()))
        return parts

    def _reply(self, k: int, parts: List[np.ndarray], extra: Optional[dict] = None) -> None:
        """Send the parameters to worker ``k`` straight from their memory (``_settle_param_sends`` guards it)."""
        active = [self.pushes[j] for j in self.active]
        ahead = self.pushes[k] - min(active) if active else 0
        nbytes = sum(p.size for p in parts)
        fields = {"version": self.version, "held": k in self.held, "ahead": ahead,
                  "staleness": self.staleness[k], "changes": list(self.changes), "nbytes": nbytes,
                  **(extra or {})}
        self.held.discard(k)
        self.owed.discard(k)
        self.sent_version[k] = self.version
        self.last_heard[k] = time.monotonic()  # it computes from now on
        self._send(k, Header(protocol.PARAMS, fields))
        dest = self._worker_rank(k)
        # only sends from the parameters' own memory hold back the next update; copies of grouped small
        # parameters are left to complete on their own (an asynchronous update then never waits on the
        # worker before it to take its reply)
        self.param_sends.extend((r, k) for r in payload.send_parts(self.comm, parts, dest,
                                                                   protocol.TAG_TO_WORKER_DATA,
                                                                   copied=self.requests))
        self.bytes_sent += nbytes

    def _settle_param_sends(self) -> None:
        """Wait until every worker has the parameters sent to it, before they change (no copy was made). The
        workers are waiting for them, so this is short; a worker that stopped receiving is an error."""
        deadline = time.monotonic() + self.timeout if self.timeout is not None else float("inf")
        while self.param_sends:
            self.param_sends = [(r, k) for r, k in self.param_sends if not r.Test()]
            if self.param_sends:
                os.sched_yield()  # the workers still receiving may share this core
            if self.param_sends and time.monotonic() > deadline:
                late = sorted({k for _, k in self.param_sends})
                self.param_sends = []
                self._fail(StallError(f"worker {late[0]} (rank {self._worker_rank(late[0])}) did not take the "
                                      f"parameters sent to it for {self.timeout:g} s: it died or stopped "
                                      f"(workers: {late})"))

    def _apply(self, decision: Decision) -> None:
        for update in decision.updates:
            self._settle_param_sends()
            started = time.perf_counter()
            if self.optimizer is not None:
                last = update[-1][0]
                for index, group in zip(self.group_index, self.optimizer.param_groups):
                    set_hyper(group, self.hyper[last][index])
                with torch.no_grad():
                    for n in self.names:
                        p = self.params[n]
                        # with layer selection a push may leave a parameter out: it counts as zero in this
                        # update (its gradient waits on the worker); a push with no gradient for it (frozen,
                        # unused this step) leaves it out, and with no gradient at all the optimizer skips it
                        terms = [(self.grads[k][n], w) for k, w in update if n in self.grads[k]]
                        if terms and decision.average:  # bsp: the mean over the workers that had a gradient
                            taking = sum(1 for k, _ in update if n not in self.absent.get(k, ()))
                            terms = [(g, 1.0 / taking) for g, _ in terms]
                        p.grad = weighted_sum([g for g, _ in terms], [w for _, w in terms], p.dtype) \
                            if terms else None
                self.optimizer.step()
            for k, _ in update:
                self.staleness[k] = self.version - self.sent_version[k]
                self.grads.pop(k, None)
                self.absent.pop(k, None)
            self.version += 1
            if self.timeline is not None:
                self.timeline.span(f"server {self.rank}", "update", started, time.perf_counter(),
                                   {"workers": [k for k, _ in update], "version": self.version}, kind="ps")
        if decision.reply:
            parts = self._param_parts()
            for k in decision.reply:
                if k in self.active:
                    self._reply(k, parts)
        self._note_changes()

    def _note_changes(self) -> None:
        changes = getattr(self.policy, "changes", None)
        if changes is None or len(changes) == len(self.changes):
            return
        for change in changes[len(self.changes):]:
            change = dict(change, version=self.version)
            self.changes.append(change)
            if self.timeline is not None:
                self.timeline.mark(f"sync group {change['sync_group']} s={change['s']} "
                                   f"at update {change['update']}")

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """Parameters, optimizer state and bookkeeping; gradients still in flight (a bsp round or an adaptive
        list not yet aggregated) are not part of it: their workers compute them again after a resume."""
        iterations = {k: self.pushes[k] - (1 if k in self.grads else 0) for k in range(self.num_workers)}
        return {"server": self.rank, "names": list(self.names), "sync": self.sync, "num_workers": self.num_workers,
                "params": {n: t.detach().clone() for n, t in self.params.items()},
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "version": self.version, "iterations": iterations, "epochs": dict(self.epochs),
                "policy": self.policy.state(), "changes": [dict(c) for c in self.changes],
                "buffers": {n: t.clone() for n, t in self.buffers.items()}}

    def _load(self, state: Any) -> None:
        """Restore ``state()`` (or the file ``ps.save`` wrote it to) once every worker asked for it."""
        if isinstance(state, str):
            try:
                state = torch.load(state, weights_only=False)
            except Exception as e:
                self._fail(FusionRingError(f"load_state_dict(): server rank {self.rank} cannot read {state}: {e}"))
        if state.get("names") != self.names:
            self._fail(ValueError(f"load_state_dict(): the saved state of server rank {state.get('server')} holds "
                                  f"parameters {state.get('names')}, this server holds {self.names}"))
        for key, mine in (("sync", self.sync), ("num_workers", self.num_workers)):
            if state[key] != mine:
                self._fail(ValueError(f"load_state_dict(): the state was saved with {key}={state[key]!r}, this "
                                      f"job has {key}={mine!r}"))
        saved_buffers = state.get("buffers") or {}
        if self.buffers and saved_buffers and sorted(saved_buffers) != sorted(self.buffers):
            self._fail(ValueError(f"load_state_dict(): the state holds buffers {sorted(saved_buffers)}, this job's "
                                  f"named_buffers are {sorted(self.buffers)}"))
        self._settle_param_sends()
        with torch.no_grad():
            for n in self.names:
                self.params[n].copy_(state["params"][n])
            if self.buffers:  # a state saved without buffers keeps worker 0's
                for n, t in saved_buffers.items():
                    self.buffers[n].copy_(t)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.pushes = {int(k): int(v) for k, v in state["iterations"].items()}
        self.epochs = {int(k): int(v) for k, v in state["epochs"].items()}
        self.sent_version = {k: self.version for k in range(self.num_workers)}
        self.staleness = {k: 0 for k in range(self.num_workers)}
        self.policy.load_state(state["policy"])
        self.changes = [dict(c) for c in state["changes"]]

    def _on_load(self, k: int, fields: dict) -> None:
        if k in self.started:
            self._fail(FusionRingError(f"worker {k} called load_state_dict() after training started (after its "
                                       f"step()): every worker calls it right after building "
                                       f"ps.DistributedOptimizer, before step()"))
        if self.started:  # they trained without loading: the workers to name
            late = sorted(self.started)
            self._fail(FusionRingError(
                f"worker{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not call load_state_dict() "
                f"(worker {k} did, and waits in it) and started training: every worker calls it right after "
                f"building ps.DistributedOptimizer, before step()"))
        self.owed.add(k)
        self.loading[k] = fields.get("state")
        if set(self.loading) >= self.active:
            self._load(self.loading[0])
            self.loading = {}
            if self.record is not None:
                self.record["events"].append(("load", 0, self.state()))
            parts = self._param_parts()
            for j in sorted(self.active):
                self._reply(j, parts, {"iteration": self.pushes[j], "epoch": self.epochs[j]})

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Serve until every worker has said bye."""
        if not self._start():
            return
        while self.active:
            k, header, data = self._next_message()
            f = header.fields
            if header.kind == protocol.PUSH:
                if self.loading:
                    waiting = sorted(self.loading)
                    self._fail(FusionRingError(
                        f"worker {k} did not call load_state_dict() (worker{'s' if len(waiting) > 1 else ''} "
                        f"{', '.join(map(str, waiting))} did, and wait{'' if len(waiting) > 1 else 's'} in it) and "
                        f"started training: every worker calls it right after building ps.DistributedOptimizer, "
                        f"before step()"))
                grads = payload.decode(self.decoders[k], f["layout"], data)
                self.grads[k] = grads
                self.absent[k] = protocol.absent_names(self.names, f.get("absent"))
                self.hyper[k] = f["hyper"]
                self.pushes[k] += 1
                self.started.add(k)
                now = time.monotonic()
                self.last_push[k] = now
                gap = now - self.last_any_push
                self.push_gap = gap if self.push_gap is None else 0.8 * self.push_gap + 0.2 * gap
                self.last_any_push = now
                self.warned.discard(k)
                if self.record is not None:
                    self.record["events"].append(("push", k, f["iteration"], f["hyper"],
                                                   {n: g.clone() for n, g in grads.items()},
                                                   sorted(self.absent[k])))
                decision = self.policy.push(k, f["iteration"])
                if k not in decision.reply:
                    self.held.add(k)
                    self.owed.add(k)
                self._apply(decision)
            elif header.kind == protocol.EPOCH:
                self.epochs[k] = f["epoch"]
                if self.record is not None:
                    self.record["events"].append(("epoch", k, f["epoch"]))
                self._apply(self.policy.end_epoch(k, f["epoch"]))
            elif header.kind == protocol.BYE:
                self.active.discard(k)
                self.held.discard(k)
                self.owed.discard(k)
                self.grads.pop(k, None)
                self.loading.pop(k, None)
                if self.record is not None:
                    self.record["events"].append(("bye", k))
                self._apply(self.policy.leave(k))
            elif header.kind == protocol.SAVE:
                saved = {"path": f["path"]}
                try:
                    torch.save(self.state(), f["path"])
                except (OSError, RuntimeError) as exc:  # the job goes on; the worker raises it
                    saved["error"] = f"server rank {self.rank} could not write {f['path']}: {exc}"
                self._send(k, Header(protocol.SAVED, saved))
            elif header.kind == protocol.STATE:
                buffer = io.BytesIO()
                torch.save(self.state(), buffer)
                state = np.frombuffer(buffer.getbuffer(), dtype=np.uint8).copy()
                self._send(k, Header(protocol.STATE, {"nbytes": state.size}), state)
            elif header.kind == protocol.LOAD:
                self._on_load(k, f)
            elif header.kind == protocol.FAILED:
                self._fail(_ERROR_TYPES.get(f.get("type"), FusionRingError)(f["message"]))
            elif header.kind == protocol.HEARTBEAT:
                pass  # _receive noted it
            elif header.kind == _UNBLOCK:
                if self.record is not None:
                    self.record["events"].append(("unblock",))
                self.last_any_push = time.monotonic()
                self._apply(self.policy.unblock())
            else:
                self._fail(FusionRingError(f"worker {k} sent an unexpected {header.kind!r} message"))
        self._settle_param_sends()
        for r in self.requests:
            r.Wait()
        if self.timeline is not None:
            self.timeline.close()
        if self.record is not None:
            self.record["final"] = {n: t.detach().clone() for n, t in self.params.items()}
            self.record["bytes_received"], self.record["bytes_sent"] = self.bytes_received, self.bytes_sent
            torch.save(self.record, f"{settings().ps_record_path}.server{self.rank}")


# Not a message: _next_message's word for "a quiet spell ended the wait" (see Server._quiet_spell).
_UNBLOCK = "unblock"
_QUIET_MIN_S = 0.5

# What a worker's failure message may name; anything else arrives as a FusionRingError.
_ERROR_TYPES = {"ValueError": ValueError, "TensorMismatchError": TensorMismatchError}

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"parameter dtype {name} is not a floating-point dtype the server handles")
    return _DTYPES[name]


def serve(comm: Any, num_servers: int) -> None:
    """Run this rank's server until every worker has shut down."""
    Server(comm, num_servers).run()
