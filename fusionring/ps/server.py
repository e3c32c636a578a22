"""The server role: hold a shard of the parameters, apply the pushes the sync policy lets through, answer workers.

A server polls MPI for worker messages (``Iprobe``, so a silent worker becomes an error after the stall timeout
rather than a hang), feeds each arrival to the policy of ``sync.py``, runs the optimizer steps the policy's decision
lists and sends the new parameters to the workers it names. Everything it does is a function of the order in which
messages arrive.

Optimizer: for ``bsp`` and ``ssp`` the server builds the wrapped optimizer's own class with the worker's param-group
hyper-parameters, so momentum, Adam or weight decay act as they would locally. For ``asp`` and ``adaptive`` it
applies plain SGD steps (``W <- W - lr * g``, the lr of the pushing worker's group): momentum accumulated over
gradients from different, stale parameter versions makes asynchronous training diverge.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..config import settings
from ..exceptions import FusionRingError, StallError, TensorMismatchError
from . import payload, protocol
from .protocol import Header
from .sync import Decision, make_policy


class Server:
    """One server rank's loop. ``run()`` returns once every worker has shut down; it raises on a fault after
    telling every worker still there what happened."""

    def __init__(self, comm: Any, num_servers: int) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.num_servers = num_servers
        self.num_workers = comm.Get_size() - num_servers
        self.timeout = protocol.timeout_s()
        self.nap = settings().ps_poll_sleep_us / 1e6
        self.active = set(range(self.num_workers))
        self.held: set = set()                 # workers waiting on a reply the policy holds back
        self.last_heard = {k: time.monotonic() for k in range(self.num_workers)}
        self.grads: Dict[int, Dict[str, torch.Tensor]] = {}
        self.hyper: Dict[int, List[dict]] = {}
        self.pushes = {k: 0 for k in range(self.num_workers)}
        self.sent_version = {k: 0 for k in range(self.num_workers)}
        self.staleness = {k: 0 for k in range(self.num_workers)}
        self.version = 0
        self.changes: List[dict] = []
        self.requests: List[Any] = []
        self.timeline = None

    # ------------------------------------------------------------------ messaging
    def _worker_rank(self, k: int) -> int:
        return self.num_servers + k

    def _send(self, k: int, header: Header, data: Optional[np.ndarray] = None) -> None:
        dest = self._worker_rank(k)
        self.requests.append(self.comm.isend(header, dest=dest, tag=protocol.TAG_TO_WORKER))
        if data is not None:
            self.requests.append(self.comm.Isend(data, dest=dest, tag=protocol.TAG_TO_WORKER_DATA))
        if len(self.requests) > 64:
            self.requests = [r for r in self.requests if not r.Test()]

    def _fail(self, error: Exception) -> None:
        """Tell every worker still there, then raise ``error``."""
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
        if nbytes is not None:
            data = np.empty(nbytes, dtype=np.uint8)
            self.comm.Recv(data, source=source, tag=protocol.TAG_TO_SERVER_DATA)
        k = source - self.num_servers
        self.last_heard[k] = time.monotonic()
        return k, header, data

    def _next_message(self, waiting_for_hello: bool = False) -> tuple:
        """Poll for the next header; a worker silent past the timeout while this server owes it nothing is dead."""
        from mpi4py import MPI
        status = MPI.Status()
        spins = 0
        while not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_TO_SERVER, status=status):
            spins += 1
            if spins % 64 == 0:
                now = time.monotonic()
                silent = [k for k in sorted(self.active - self.held) if now - self.last_heard[k] > self.timeout]
                if silent:
                    ranks = [self._worker_rank(k) for k in silent]
                    what = "sent no model description" if waiting_for_hello else "sent nothing"
                    self._fail(StallError(
                        f"worker {silent[0]} (rank {ranks[0]}) {what} for {self.timeout:g} s: it died or exited "
                        f"without ps.shutdown() (silent workers: {silent}; limit: FUSIONRING_STALL_SHUTDOWN_S "
                        f"or FUSIONRING_PS_TIMEOUT_S)"))
                if self.nap > 0:
                    time.sleep(self.nap)
        return self._receive(status)

    # ------------------------------------------------------------------ start
    def _start(self) -> None:
        """Every worker's hello: check the models agree with worker 0's, build parameters and optimizer."""
        hellos: Dict[int, dict] = {}
        values = None
        while len(hellos) < self.num_workers:
            k, header, data = self._next_message(waiting_for_hello=True)
            if header.kind != protocol.HELLO:
                self._fail(FusionRingError(f"worker {k} sent {header.kind!r} before its model description"))
            hellos[k] = header.fields
            if k == 0:
                values = data
        ref = hellos[0]
        for k in range(1, self.num_workers):
            problem = protocol.model_mismatch(ref["model"], hellos[k]["model"], k)
            if problem is not None:
                self._fail(TensorMismatchError(f"the workers' models differ: {problem}"))
            for key in ("sync", "staleness", "slack", "optimizer"):
                if hellos[k][key] != ref[key]:
                    self._fail(ValueError(f"{key}: worker 0 has {ref[key]!r}, worker {k} has {hellos[k][key]!r}"))
        self.sync = ref["sync"]
        self.policy = make_policy(ref["sync"], self.num_workers, ref["staleness"], ref["slack"])
        model = ref["model"]
        names = [n for n, _, _ in model]
        nbytes = [int(np.prod(s)) * torch.empty((), dtype=_dtype(d)).element_size() for _, s, d in model]
        self.names = protocol.shard_names(names, nbytes, self.num_servers)[self.rank]
        shapes = {n: (s, d) for n, s, d in model}
        self.params: Dict[str, torch.Tensor] = {
            n: torch.empty(shapes[n][0], dtype=_dtype(shapes[n][1])) for n in self.names}
        payload.unpack_into(values, [self.params[n] for n in self.names])
        self.decoders = {k: payload.build_decoder(h["decoder"]) for k, h in hellos.items()}
        self.optimizer = self._build_optimizer(ref["optimizer"], ref["groups"])
        if settings().timeline_path:
            from ..timeline import Timeline
            self.timeline = Timeline(f"{settings().timeline_path}.ps{self.rank}")
        packed = self._packed()
        for k in range(self.num_workers):
            self._reply(k, packed)

    def _build_optimizer(self, optimizer_class: type, groups: List[dict]) -> torch.optim.Optimizer:
        own = set(self.names)
        self.group_names: List[List[str]] = []
        built = []
        for g in groups:
            mine = [n for n in g["names"] if n in own]
            if not mine:
                continue
            hyper = dict(g["hyper"])
            if self.sync in ("asp", "adaptive"):
                hyper = {"lr": hyper.get("lr", 0.01)}  # plain SGD: see the module's docstring
            built.append({"params": [self.params[n] for n in mine], **hyper})
            self.group_names.append(mine)
        self.group_index = [i for i, g in enumerate(groups) if any(n in own for n in g["names"])]
        if not built:  # more servers than parameters: this one holds none
            return None
        cls = torch.optim.SGD if self.sync in ("asp", "adaptive") else optimizer_class
        return cls(built)

    # ------------------------------------------------------------------ updates and replies
    def _packed(self) -> np.ndarray:
        return payload.pack([self.params[n] for n in self.names])

    def _reply(self, k: int, packed: np.ndarray) -> None:
        active = [self.pushes[j] for j in self.active]
        ahead = self.pushes[k] - min(active) if active else 0
        fields = {"version": self.version, "held": k in self.held, "ahead": ahead,
                  "staleness": self.staleness[k], "changes": list(self.changes), "nbytes": packed.size}
        self.held.discard(k)
        self.sent_version[k] = self.version
        self.last_heard[k] = time.monotonic()  # it computes from now on
        self._send(k, Header(protocol.PARAMS, fields), packed)

    def _apply(self, decision: Decision) -> None:
        for update in decision.updates:
            if self.optimizer is not None:
                last = update[-1][0]
                for index, group in zip(self.group_index, self.optimizer.param_groups):
                    group["lr"] = self.hyper[last][index]["lr"]
                    if self.sync in ("bsp", "ssp"):
                        for key, value in self.hyper[last][index].items():
                            if key in group and isinstance(value, (int, float)) and not isinstance(value, bool):
                                group[key] = value
                with torch.no_grad():
                    for n in self.names:
                        total = None
                        for k, weight in update:
                            g = self.grads[k][n].to(self.params[n].dtype)
                            total = g * weight if total is None else total.add_(g, alpha=weight)
                        self.params[n].grad = total
                self.optimizer.step()
            for k, _ in update:
                self.staleness[k] = self.version - self.sent_version[k]
                self.grads.pop(k, None)
            self.version += 1
        if decision.reply:
            packed = self._packed()
            for k in decision.reply:
                if k in self.active:
                    self._reply(k, packed)
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

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Serve until every worker has said bye."""
        self._start()
        while self.active:
            k, header, data = self._next_message()
            f = header.fields
            if header.kind == protocol.PUSH:
                self.grads[k] = payload.decode(self.decoders[k], f["layout"], data)
                self.hyper[k] = f["hyper"]
                self.pushes[k] += 1
                decision = self.policy.push(k, f["iteration"])
                if k not in decision.reply:
                    self.held.add(k)
                self._apply(decision)
            elif header.kind == protocol.EPOCH:
                self._apply(self.policy.end_epoch(k, f["epoch"]))
            elif header.kind == protocol.BYE:
                self.active.discard(k)
                self.held.discard(k)
                self.grads.pop(k, None)
                self._apply(self.policy.leave(k))
            else:
                self._fail(FusionRingError(f"worker {k} sent an unexpected {header.kind!r} message"))
        for r in self.requests:
            r.Wait()
        if self.timeline is not None:
            self.timeline.close()


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"parameter dtype {name} is not a floating-point dtype the server handles")
    return _DTYPES[name]


def serve(comm: Any, num_servers: int) -> None:
    """Run this rank's server until every worker has shut down."""
    Server(comm, num_servers).run()
