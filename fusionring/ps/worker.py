"""The worker role and the job's entry points: ``init``, ``DistributedOptimizer``, ``shutdown``, ``stats``.

``init(num_servers)`` makes the first ``num_servers`` ranks servers (they serve inside ``init()`` and exit with
status 0 once every worker has shut down); the other ranks are workers and return. A worker's optimizer pushes its
gradient to every server (each gets the parameters it holds, split by bytes), waits for their replies and loads the
new parameters; the wrapped optimizer itself never steps on the worker.
"""
from __future__ import annotations

import atexit
import io
import os
import sys
import threading
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from .. import launch_checks
from ..compression import Compression
from ..compression.base import capabilities, resolve_compressor
from ..config import settings
from ..exceptions import FusionRingError, NotInitializedError, StallError, TensorMismatchError
from ..process_exit import exit_nonzero_without_finalize, exit_on_uncaught, record_process
from ..straggler import Straggler
from . import payload, protocol
from .protocol import Header
from .sync import SYNC_MODES

STATE_FORMAT = "fusionring.ps.state/1"
_ERRORS = {"StallError": StallError, "TensorMismatchError": TensorMismatchError, "ValueError": ValueError}


class _Job:
    """This process's place in the job (set by ``init``)."""

    def __init__(self, comm: Any, num_servers: int) -> None:
        self.comm = comm
        self.num_servers = num_servers
        self.rank = comm.Get_rank()
        self.requests: List[Any] = []
        self.stats: Dict[str, Any] = {"pushes": 0, "waits": 0, "staleness_max": 0, "staleness_sum": 0,
                                      "ahead_max": 0, "bytes_sent": 0, "bytes_received": 0,
                                      "group_changes": [], "version": 0}
        self.closed = False
        self.optimizer: Optional["DistributedOptimizer"] = None
        self.heartbeat: Optional[_Heartbeat] = None

    def close(self) -> None:
        """This worker sends nothing more: it shut down, or the job failed."""
        self.closed = True
        if self.heartbeat is not None:
            self.heartbeat.stop()


class _Heartbeat:
    """A daemon thread that sends every server a small message every few seconds while this worker's process lives.

    So a worker that is busy elsewhere for a long time (evaluation, writing a checkpoint, a slow data loader) is
    never taken for dead, while one whose process died, whose interpreter is frozen (a call holding the GIL, a
    deadlock of the whole process) or that exited without ``ps.shutdown()`` falls silent. Started only when
    there is a time limit (nobody reads the beats otherwise). Needs MPI_THREAD_MULTIPLE (mpi4py's default)."""

    def __init__(self, job: _Job, interval: float) -> None:
        self.job = job
        self.interval = interval
        self.done = threading.Event()
        self.requests: List[Any] = []
        self.thread = threading.Thread(target=self._run, name="fusionring-ps-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self._beat()
            if self.done.wait(self.interval):
                return

    def _beat(self) -> None:
        self.requests = [r for r in self.requests if not r.Test()]
        if len(self.requests) > 16 * self.job.num_servers:
            return  # a server that stopped receiving: it fails on its own; do not pile up sends to it
        for server in range(self.job.num_servers):
            # on the header tag: a server receives every beat before the goodbye sent after it
            self.requests.append(self.job.comm.isend(Header(protocol.HEARTBEAT), dest=server,
                                                     tag=protocol.TAG_TO_SERVER))

    def stop(self) -> None:
        """No more beats once this returns (from any thread but its own)."""
        self.done.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10.0)
            deadline = time.monotonic() + 1.0  # small messages: they leave at once unless a server is gone
            while self.requests and time.monotonic() < deadline:
                self.requests = [r for r in self.requests if not r.Test()]


def _start_heartbeat(job: _Job) -> None:
    from mpi4py import MPI
    limit = protocol.timeout_s()
    if limit is None:  # no limit: silence is never taken for death
        return
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        warnings.warn("fusionring.ps: MPI runs without MPI_THREAD_MULTIPLE, so workers send no heartbeat: a "
                      "worker that goes longer than the stall limit (FUSIONRING_PS_TIMEOUT_S) between pushes is "
                      "taken for dead. Let mpi4py initialize MPI (its default is MPI_THREAD_MULTIPLE).",
                      stacklevel=3)
        return
    job.heartbeat = _Heartbeat(job, protocol.heartbeat_interval(limit))
    # before mpi4py's MPI_Finalize (atexit runs the last registered first): a process that exits without
    # ps.shutdown() falls silent, and no beat races MPI's end
    atexit.register(job.heartbeat.stop)


def init_would_wait(comm: Any) -> Optional[str]:
    """Why ``hvd.init(comm)`` in this process would wait forever (None when it would not): after
    ``ps.init()``, on a communicator that holds server ranks, which serve inside ``ps.init()`` and never join
    it. Called by fusionring's ``init()`` before it starts its runtime."""
    if _job is None or not _holds_servers(_job, comm):
        return None
    return ("hvd.init() was called after ps.init(): the server ranks serve inside ps.init() and never join it, "
            "so it would wait for them forever. Call hvd.init() on every rank before ps.init(), or leave it out "
            "(the parameter server itself needs no hvd.init())")


def _holds_servers(job: _Job, comm: Any) -> bool:
    """Whether ``init(comm)`` needs the servers: every rank (None), a list of ranks (carved out of the world by
    every rank), or a communicator with a server in it."""
    if comm is None or isinstance(comm, (list, tuple)):
        return True
    try:
        from mpi4py import MPI
        group, world = comm.Get_group(), job.comm.Get_group()
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
        group.Free()
        world.Free()
    except Exception:  # noqa: BLE001 -- not a communicator this check understands: let init() judge it
        return False
    return any(r is not None and 0 <= r < job.num_servers for r in ranks)


_job: Optional[_Job] = None


def _require_worker(what: str) -> _Job:
    if _job is None:
        raise NotInitializedError(what)
    if _job.closed:
        raise FusionRingError(f"{what} after ps.shutdown()")
    return _job


def init(num_servers: int = 1) -> None:
    """Start the job: ranks ``[0, num_servers)`` run the server here and exit with status 0 when every worker has
    shut down; the other ranks are workers and return."""
    global _job
    if "mpi4py.MPI" not in sys.modules:  # once MPI is up, this process is a rank
        launch_checks.not_a_worker_process("ps.init()")
        launch_checks.launcher_reachable("ps.init()")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size == 1:
        launch_checks.not_a_lone_copy(MPI)
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 1 <= num_servers < size:
        raise ValueError(f"num_servers must be an int in [1, world size - 1] = [1, {size - 1}] (at least one "
                         f"rank must be a worker), got {num_servers!r}")
    if _job is not None:
        return
    _job = _Job(comm, num_servers)
    record_process(_job.rank)  # fusionrun names a killed rank by it
    if _job.rank < num_servers:
        from .server import serve
        serve(comm, num_servers)
        sys.exit(0)
    _report_uncaught_exceptions()
    exit_on_uncaught(_nothing)  # Ctrl-C on a worker, too, ends the job at once
    _start_heartbeat(_job)


def _nothing() -> None:
    pass


def _report_uncaught_exceptions() -> None:
    """A worker whose script ends on an exception (a bad argument, a bug mid-training) tells the servers before
    its traceback is printed, so every rank fails at once naming it; a caught exception changes nothing."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        job = _job
        if job is not None and not job.closed and job.rank >= job.num_servers and not issubclass(
                kind, KeyboardInterrupt):
            try:
                _report_failure(job, value)
            except Exception:  # noqa: BLE001 -- the original error matters more
                pass
        previous(kind, value, traceback)

    sys.excepthook = hook


def is_server() -> bool:
    """True on a server rank (only seen before ``init`` returns, as servers exit inside it)."""
    if _job is None:
        raise NotInitializedError("ps.is_server()")
    return _job.rank < _job.num_servers


def worker_rank() -> int:
    """This worker's index among the workers, 0 .. num_workers() - 1."""
    if _job is None:
        raise NotInitializedError("ps.worker_rank()")
    return _job.rank - _job.num_servers


def num_workers() -> int:
    """How many workers the job has (world size minus servers)."""
    if _job is None:
        raise NotInitializedError("ps.num_workers()")
    return _job.comm.Get_size() - _job.num_servers


def stats() -> Dict[str, Any]:
    """This worker's counters: pushes, waits (steps whose reply a server held back for the sync rule, one per step
    however many servers held it), staleness seen (server updates between its pull and its gradient's update, per
    step the largest over the servers: max, sum and mean), ``ahead_max`` (iterations ahead of the slowest worker
    when answered), bytes sent and received, and the adaptive mode's group changes."""
    if _job is None:
        raise NotInitializedError("ps.stats()")
    s = dict(_job.stats)
    s["staleness_mean"] = s["staleness_sum"] / s["pushes"] if s["pushes"] else 0.0
    s["group_changes"] = list(s["group_changes"])
    return s


def shutdown() -> None:
    """Tell every server this worker is done (the servers stop waiting for it); idempotent."""
    job = _job
    if job is None or job.closed or job.rank < job.num_servers:
        return
    if job.heartbeat is not None:
        job.heartbeat.stop()
    for server in protocol.server_ranks(job.num_servers):
        job.requests.append(job.comm.isend(Header(protocol.BYE), dest=server, tag=protocol.TAG_TO_SERVER))
    for r in job.requests:
        r.Wait()
    job.requests = []
    job.close()


def save(path: str) -> None:
    """Checkpoint the job: on worker 0, ask every server to write its parameters, optimizer state, sync
    bookkeeping (and server 0 the buffers) to ``<path>.server<s>`` and write ``path``, the index a new job loads
    with ``opt.load_state_dict(torch.load(path))``; it also holds worker 0's param-group settings (the lr an LR
    scheduler set). Every worker that calls it (worker 0 included) also writes its own state, where it has any
    (compression residuals, layer selection), to ``<path>.worker<k>``; call it on every worker so that none of
    them resumes without its residuals."""
    job = _require_worker("ps.save()")
    opt = job.optimizer
    if opt is None:
        raise FusionRingError("ps.save() before ps.DistributedOptimizer: there is nothing on the servers yet")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(os.path.dirname(path)):
        raise FileNotFoundError(f"ps.save({path!r}): the directory {os.path.dirname(path)!r} does not exist")
    own = opt._worker_state()
    if len(own) > 1:  # more than its index
        torch.save(own, f"{path}.worker{own['index']}")
    if job.rank != job.num_servers:
        return
    files = [f"{path}.server{server}" for server in range(len(opt._shards))]
    replies = opt._ask_servers(protocol.SAVE, [{"path": f} for f in files], protocol.SAVED)
    failed = [header.fields["error"] for header, _ in replies if "error" in header.fields]
    if failed:  # servers on other hosts write beside `path` on their own file systems
        raise OSError(f"ps.save({path!r}): " + "; ".join(failed))
    torch.save({"format": STATE_FORMAT, "num_servers": len(opt._shards), "shards": opt._shards, "servers": files,
                "worker_files": f"{path}.worker{{}}", "param_groups": opt._param_group_state()}, path)


def _wait_reply(job: _Job, server: int, silence: Optional[float],
                expect: str = protocol.PARAMS) -> Tuple[Header, Optional[np.ndarray]]:
    """The next reply from ``server``; its error message raised as an error. The server sends its heartbeat
    while it makes this worker wait (the sync rule holds it back), so only ``silence`` seconds without a reply
    or a heartbeat are an error (None: no limit)."""
    from mpi4py import MPI
    status = MPI.Status()
    while True:
        deadline = float("inf") if silence is None else time.monotonic() + silence
        try:
            protocol.poll_until(lambda: job.comm.Iprobe(source=server, tag=protocol.TAG_TO_WORKER, status=status),
                                deadline, lambda: f"server rank {server} sent worker {job.rank - job.num_servers} "
                                                  f"nothing, not even its heartbeat, for {silence:g} s: it died or "
                                                  f"stopped")
        except StallError:
            job.close()
            exit_nonzero_without_finalize()  # the server is gone: MPI_Finalize would wait for it
            raise
        header: Header = job.comm.recv(source=server, tag=protocol.TAG_TO_WORKER)
        if header.kind != protocol.HEARTBEAT:
            break
    if header.kind == protocol.ERROR:
        job.close()
        exit_nonzero_without_finalize()
        raise _ERRORS.get(header.fields.get("type"), FusionRingError)(header.fields["message"])
    if header.kind != expect:
        raise FusionRingError(f"server rank {server} answered {header.kind!r} where worker "
                              f"{job.rank - job.num_servers} expected {expect!r}")
    if "nbytes" not in header.fields or header.kind == protocol.PARAMS:
        return header, None  # parameters are received straight into the model (DistributedOptimizer)
    data = np.empty(header.fields["nbytes"], dtype=np.uint8)
    job.comm.Recv(data, source=server, tag=protocol.TAG_TO_WORKER_DATA)
    job.stats["bytes_received"] += data.size
    return header, data


def _report_failure(job: Any, error: BaseException) -> None:
    """Tell every server that this worker is ending on `error`: they fail the job on every rank with its
    message at once, instead of waiting out their time limit for a worker gone silent. This process then exits
    with status 1 (not waiting in MPI_Finalize for peers that may be gone)."""
    if job.heartbeat is not None:
        job.heartbeat.stop()
    _send_failure(job, error)
    job.close()
    exit_nonzero_without_finalize()


def _send_failure(job: Any, error: BaseException) -> None:
    """The FAILED message to every server, waited for (briefly) so it leaves before this process ends."""
    worker = job.rank - job.num_servers
    text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    header = Header(protocol.FAILED, {"message": f"worker {worker} (rank {job.rank}): {text}",
                                      "type": type(error).__name__})
    requests = [job.comm.isend(header, dest=server, tag=protocol.TAG_TO_SERVER)
                for server in range(job.num_servers)]
    deadline = time.monotonic() + 2.0  # let the message leave before this process exits
    while requests and time.monotonic() < deadline:
        requests = [r for r in requests if not r.Test()]
        time.sleep(0.01)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer for a parameter-server job: ``step()`` pushes this worker's gradient to the servers,
    waits for their reply (the sync rule may hold it back) and loads the new parameters.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``defaults`` and ``state`` are the wrapped
    optimizer's own, so an LR scheduler (``torch.optim.lr_scheduler``) takes either, and the servers follow the
    hyper-parameters it sets with each push.

    ``sync``: "bsp" | "asp" | "ssp" | "adaptive" (see docs/ps.md); ``staleness``: ssp's bound in iterations;
    ``slack``: adaptive's slack factor (None: ``sync.DEFAULT_SLACK``); ``compression``: any fusionring compressor
    (per-rank payloads are decoded on arrival; a shared N:M mask is refused).
    ``layer_selection``: a ``LayerSelection`` (as for ``fusionring.torch.DistributedOptimizer``): each worker pushes
    only its own top-k layers, the others accumulate on the worker (error feedback) and travel later.
    ``named_buffers``: ``model.named_buffers()`` (BatchNorm's running statistics): every worker starts with worker
    0's, takes worker 0's latest with each reply, and checkpoints hold them; without it each worker keeps its own,
    never saved.

    A parameter whose ``grad`` is None at ``step()`` (frozen, or unused this step) is not sent and, as torch's
    optimizers skip it, not stepped by its push; sparse gradients travel dense.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                 sync: str = "adaptive", staleness: int = 3, slack: Optional[float] = None,
                 compression: Any = Compression.none, layer_selection: Any = None,
                 named_buffers: Optional[Iterable] = None) -> None:
        job = _require_worker("ps.DistributedOptimizer")
        compression = resolve_compressor(compression)
        if job.optimizer is not None:  # this worker's job goes on with its first one
            raise ValueError("a parameter-server job has one ps.DistributedOptimizer per worker")
        named = self._check(optimizer, named_parameters, sync, staleness, slack, compression,
                            layer_selection)
        buffers = self._check_buffers(named_buffers)
        # each worker picks its own layers (no agreement, as the server decodes every push on its own); the
        # layers it does not send wait in the selection's accumulator (error feedback)
        if layer_selection is not None:
            layer_selection.attach(named)
        # Optimizer.__init__ sets up torch's hook tables; the groups, defaults and state are then the wrapped
        # optimizer's own objects, so that a scheduler changing one changes both.
        self._wrapping = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._wrapping = True
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self.optimizer = optimizer
        self.sync, self.staleness, self.slack = sync, staleness, slack
        self.compression = compression
        self.layer_selection = layer_selection
        names = [n for n, _ in named]
        by_id = {id(p): n for n, p in named}
        self._job = job
        self._straggler = Straggler.from_settings()
        self._named = named
        self._params = dict(named)
        self._landing: Dict[str, torch.Tensor] = {}  # a GPU model's parameters arrive here
        self._buffers = buffers
        # server 0's replies carry worker 0's buffers as one packed part, received here
        self._buffer_landing = torch.empty(sum(b.numel() * b.element_size() for _, b in buffers), dtype=torch.uint8)
        self._group_names = [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        model = protocol.describe_model(named)
        nbytes = [p.numel() * p.element_size() for _, p in named]
        self._shards = protocol.shard_names(names, nbytes, job.num_servers)
        self._iteration = 0
        self._epoch = 0
        self._in_flight: List[np.ndarray] = []
        groups = [{"names": gn, "hyper": self._hyper(g)} for gn, g in zip(self._group_names, optimizer.param_groups)]
        spec = payload.decoder_spec(compression)
        for server, shard in enumerate(self._shards):
            fields = {"model": model, "groups": groups, "optimizer": type(optimizer), "sync": sync,
                      "staleness": staleness, "slack": slack, "decoder": spec,
                      "buffers": protocol.describe_model(buffers) if server == 0 else []}
            data = None
            if job.rank == job.num_servers:  # worker 0: the initial parameters (and, to server 0, buffers)
                data = payload.pack([self._params[n] for n in shard] +
                                    ([b for _, b in buffers] if server == 0 else []))
                fields["nbytes"] = data.size
            self._send(server, Header(protocol.HELLO, fields), data)
        job.optimizer = self
        self._receive_params(first=True)

    @staticmethod
    def _check(optimizer: Any, named_parameters: Optional[Iterable], sync: Any, staleness: Any,
               slack: Any, compression: Any, layer_selection: Any) -> List[Tuple[str, torch.Tensor]]:
        """The arguments' ValueError, naming the argument; the named parameters when they are right."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {staleness!r}")
        if slack is not None and (isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 0):
            raise ValueError(f"slack must be a non-negative number or None, got {slack!r}")
        payload.check_compressor(compression)
        if named_parameters is None:
            raise ValueError("named_parameters is required: pass model.named_parameters()")
        named = list(named_parameters)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters: names {dup} appear more than once")
        by_id = {id(p): n for n, p in named}
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in by_id:
                    raise ValueError(f"named_parameters: a parameter of shape {list(p.shape)} in the optimizer's "
                                     f"param group {i} is not among the named parameters")
        if layer_selection is not None and not callable(getattr(layer_selection, "attach", None)):
            raise ValueError(f"layer_selection: {layer_selection!r} is not a LayerSelection")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError("optimizer: torch.optim.SparseAdam steps sparse gradients only, and gradients reach "
                             "the servers dense; use Adam (or SGD) instead")
        return named

    @staticmethod
    def _check_buffers(named_buffers: Optional[Iterable]) -> List[Tuple[str, torch.Tensor]]:
        """``named_buffers`` as a list; ValueError naming the argument when it is not (name, tensor) pairs."""
        if named_buffers is None:
            return []
        buffers = list(named_buffers)
        for item in buffers:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise ValueError(f"named_buffers: expected (name, tensor) pairs such as model.named_buffers(), got "
                                 f"{item!r:.80}")
            try:
                payload.tensor_dtype(str(item[1].dtype))
            except ValueError:
                raise ValueError(f"named_buffers: buffer {item[0]!r} is {item[1].dtype}, which cannot travel to a "
                                 f"parameter server") from None
        names = [n for n, _ in buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"named_buffers: names {sorted({n for n in names if names.count(n) > 1})} appear more "
                             f"than once")
        return buffers

    # ------------------------------------------------------------------ torch.optim.Optimizer's face
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if not self.__dict__.get("_wrapping", True):  # called by Optimizer.__init__ itself
            return super().add_param_group(param_group)
        # the servers were told the model and its groups when the optimizer was built
        raise ValueError("add_param_group: a ps.DistributedOptimizer cannot take parameters after it is built "
                         "(the servers hold the model it was built with); give every param group to the "
                         "optimizer it wraps before wrapping it")

    def __repr__(self) -> str:
        return f"ps.DistributedOptimizer({self.optimizer!r}, sync={self.sync!r})"

    @staticmethod
    def _hyper(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    # ------------------------------------------------------------------ messaging
    def _send(self, server: int, header: Header, data: Optional[np.ndarray]) -> None:
        job = self._job
        job.requests.append(job.comm.isend(header, dest=server, tag=protocol.TAG_TO_SERVER))
        if data is not None:
            job.requests.append(job.comm.Isend(data, dest=server, tag=protocol.TAG_TO_SERVER_DATA))
            job.stats["bytes_sent"] += data.size

    def _receive_params(self, first: bool = False) -> List[Header]:
        job = self._job
        limit = protocol.timeout_s()
        if first:  # the server waits for every worker's model description with the longer limit
            limit = protocol.longest(limit, settings().ps_timeout_s)
        silence = protocol.times(2, limit)  # past the server's own limit on a dead peer
        headers = []
        for server, shard in enumerate(self._shards):
            header, _ = _wait_reply(job, server, silence)
            headers.append(header)
            targets = [self._params[n].data for n in shard]
            # a GPU model's parameters arrive in host memory first, then are copied to their device
            landing = [t if t.device.type == "cpu" else self._staging(n, t) for n, t in zip(shard, targets)]
            if server == 0 and self._buffers:
                landing.append(self._buffer_landing)
            received = payload.recv_into(job.comm, landing, server, protocol.TAG_TO_WORKER_DATA)
            with torch.no_grad():
                for target, landed in zip(targets, landing):
                    if landed is not target:
                        target.copy_(landed)  # before the buffer takes the next reply
            if server == 0 and self._buffers:
                payload.unpack_into(self._buffer_landing.numpy(), [b.data for _, b in self._buffers])
            if received != header.fields["nbytes"]:
                raise FusionRingError(f"server rank {server} sent {header.fields['nbytes']} bytes of parameters, "
                                      f"worker {job.rank - job.num_servers} received {received}")
            job.stats["bytes_received"] += received
            f = header.fields
            if self._iteration > 0:
                job.stats["staleness_max"] = max(job.stats["staleness_max"], f["staleness"])
                job.stats["ahead_max"] = max(job.stats["ahead_max"], f["ahead"])
            if f["changes"]:
                job.stats["group_changes"] = f["changes"]
            job.stats["version"] = f["version"]
        if self._iteration > 0:  # one wait per step, however many servers held it back
            job.stats["waits"] += int(any(h.fields["held"] for h in headers))
            # a step's staleness is its stalest shard's, as staleness_max counts it
            job.stats["staleness_sum"] += max(h.fields["staleness"] for h in headers)
        for r in job.requests:
            r.Wait()
        job.requests = []
        self._in_flight = []  # the gradients' memory may change again
        return headers

    def _staging(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A host buffer (pinned where CUDA is there) that parameter `name` of a GPU model is received into."""
        buffer = self._landing.get(name)
        if buffer is None:
            buffer = self._landing[name] = torch.empty(like.shape, dtype=like.dtype,
                                                       pin_memory=torch.cuda.is_available())
        return buffer

    # ------------------------------------------------------------------ training
    def step(self, closure: Any = None) -> Optional[float]:
        """Push this worker's gradients, wait for the servers' reply, load the new parameters."""
        job = _require_worker("DistributedOptimizer.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._straggler is not None:
            self._straggler.step()  # before the push: a slower worker pushes later
        self._iteration += 1
        hyper = [self._hyper(g) for g in self.optimizer.param_groups]
        grads = self._gradients()
        kept: set = set()
        sending = grads
        if self.layer_selection is not None:
            sending, kept = self._select(grads)
        # worker 0's buffers go to server 0 with each push, and come back to every worker with the replies
        buffers = payload.pack([b for _, b in self._buffers]) \
            if self._buffers and job.rank == job.num_servers else None
        for server, shard in enumerate(self._shards):
            # a GPU model's gradients are encoded on the host: the servers decode them there
            named = [(n, sending[n].cpu()) for n in shard if n in sending]
            layout, parts = payload.encode_parts(self.compression, named)
            nbytes = sum(p.size for p in parts)
            # the parameters with no gradient at all this step (not those layer selection keeps back): the server
            # leaves them out of this push's update, and out of bsp's average
            absent = protocol.absent_bitmap(shard, {n for n in shard if n not in sending and n not in kept})
            fields = {"iteration": self._iteration, "hyper": hyper, "layout": layout, "nbytes": nbytes,
                      "absent": absent}
            if server == 0 and buffers is not None:
                fields["buffers"] = buffers.size
            self._send(server, Header(protocol.PUSH, fields), None)
            job.requests.extend(payload.send_parts(job.comm, parts, server, protocol.TAG_TO_SERVER_DATA))
            self._in_flight.extend(parts)  # sent from this memory: keep it alive until the sends complete
            job.stats["bytes_sent"] += nbytes
            if server == 0 and buffers is not None:
                job.requests.append(job.comm.Isend(buffers, dest=0, tag=protocol.TAG_TO_SERVER_DATA))
                self._in_flight.append(buffers)
                job.stats["bytes_sent"] += buffers.size
        job.stats["pushes"] += 1
        self._receive_params()
        if self._straggler is not None:
            self._straggler.step_ended()
        # The wrapped optimizer's step ran on the servers. A learning-rate scheduler on it checks that its
        # step was called (torch's counter) and would otherwise warn that it is stepped first.
        self.optimizer._opt_called = True
        return loss

    # ------------------------------------------------------------------ state
    def _ask_servers(self, kind: str, fields_per_server: List[dict], expect: str) -> List[Tuple[Header, Any]]:
        job = self._job
        for server in range(len(self._shards)):
            self._send(server, Header(kind, fields_per_server[server]), None)
        # A server writing a checkpoint sends no heartbeat: it gets twice the limit (None: no limit).
        limit = protocol.timeout_s()
        silence = None if limit is None else 2 * limit
        replies = [_wait_reply(job, server, silence, expect) for server in range(len(self._shards))]
        for r in job.requests:
            r.Wait()
        job.requests = []
        return replies

    def state_dict(self) -> Dict[str, Any]:
        """Every server's state (its parameters, optimizer state, sync bookkeeping) and this worker's own
        (compression residuals, layer selection, under ``"worker"``) as one dict; give it to ``load_state_dict``
        in a new job. A worker restores only its own part, so keep each worker's dict. Gradients still in flight
        (pushed but not yet applied) are not part of it."""
        _require_worker("DistributedOptimizer.state_dict()")
        replies = self._ask_servers(protocol.STATE, [{} for _ in self._shards], protocol.STATE)
        servers = [torch.load(io.BytesIO(data.tobytes()), weights_only=False) for _, data in replies]
        return {"format": STATE_FORMAT, "num_servers": len(self._shards), "shards": self._shards,
                "servers": servers, "worker": self._worker_state(), "param_groups": self._param_group_state()}

    def _param_group_state(self) -> List[dict]:
        """The wrapped optimizer's param-group settings as they are now (an LR scheduler's lr included), which a
        resumed worker restores as ``torch.optim.Optimizer.load_state_dict`` does."""
        return [self._hyper(g) for g in self.optimizer.param_groups]

    def _worker_state(self) -> Dict[str, Any]:
        """What lives on this worker alone: its index, its compressor's residuals, its layer selection."""
        state: Dict[str, Any] = {"index": self._job.rank - self._job.num_servers}
        if capabilities(self.compression).stateful:
            state["compression"] = self.compression.state_dict()
        if self.layer_selection is not None:
            state["layer_selection"] = self.layer_selection.state_dict()
        return state

    def _restore_worker_state(self, state_dict: Dict[str, Any]) -> None:
        if not (capabilities(self.compression).stateful or self.layer_selection is not None):
            return
        index = self._job.rank - self._job.num_servers
        worker = state_dict.get("worker")
        pattern = state_dict.get("worker_files")
        if worker is None and pattern:  # ps.save's index: this worker's own file, where it wrote one
            file = pattern.format(index)
            worker = torch.load(file, weights_only=False) if os.path.exists(file) else None
        if not worker or worker.get("index", index) != index:
            found = "no state of any worker" if not worker else f"worker {worker.get('index')}'s state"
            warnings.warn(f"ps worker {index}: the checkpoint holds {found}, not this worker's; its compression "
                          f"residuals and layer selection start empty (call ps.save on every worker, or give "
                          f"each worker its own state_dict())", stacklevel=3)
            return
        if "compression" in worker and capabilities(self.compression).stateful:
            self.compression.load_state_dict(worker["compression"])
        if "layer_selection" in worker and self.layer_selection is not None:
            self.layer_selection.load_state_dict(worker["layer_selection"])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume from ``state_dict()`` or from the file ``ps.save`` wrote (``torch.load(path)``). Every worker
        calls it, right after building this optimizer and before its first ``step()``; the servers take worker
        0's state (a saved file is read by each server itself) and answer every worker with the restored
        parameters (and buffers), its iteration and epoch count. The wrapped optimizer's param-group settings
        (the lr an LR scheduler set included) are restored as ``torch.optim.Optimizer.load_state_dict`` does."""
        job = _require_worker("DistributedOptimizer.load_state_dict()")
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError("state_dict: not a parameter-server state (from DistributedOptimizer.state_dict() or "
                             "torch.load() of ps.save()'s file)")
        if state_dict["num_servers"] != len(self._shards) or state_dict["shards"] != self._shards:
            raise ValueError(f"state_dict: saved with {state_dict['num_servers']} servers holding "
                             f"{state_dict['shards']}, this job has {len(self._shards)} holding {self._shards}")
        groups = state_dict.get("param_groups")
        if groups is not None and len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"state_dict: saved with {len(groups)} param groups, this optimizer has "
                             f"{len(self.optimizer.param_groups)}")
        mine = job.rank == job.num_servers
        for server in range(len(self._shards)):
            fields = {"state": state_dict["servers"][server]} if mine else {}
            self._send(server, Header(protocol.LOAD, fields), None)
        headers = self._receive_params(first=True)
        self._iteration = int(headers[0].fields["iteration"])
        self._epoch = int(headers[0].fields["epoch"])
        self._restore_worker_state(state_dict)
        # the learning rate (and every other setting) where the saved run left it: the next push carries it to
        # the servers, as an uninterrupted run's would
        for group, saved in zip(self.optimizer.param_groups, groups or []):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _gradients(self) -> Dict[str, torch.Tensor]:
        """This step's gradients by name, dense. A parameter whose ``grad`` is None (frozen, or unused this
        step) has none: torch's optimizers skip it, and so does its push."""
        out: Dict[str, torch.Tensor] = {}
        for n, p in self._named:
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:  # sparse (nn.Embedding(sparse=True)): travels dense
                g = g.to_dense()
            out[n] = g
        return out

    def _select(self, grads: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], set]:
        """This worker's own top-k layers: their gradients plus what they kept back travel; the others wait.
        Returns what travels and the names kept back on the worker."""
        sel = self.layer_selection
        summed = {}
        for n in sel.params:
            if n in grads:
                summed[n] = sel.acc.add(n, grads[n].detach())
            elif n in sel.acc.residual:  # no gradient this step, but an earlier one still waits to travel
                summed[n] = sel.acc.residual[n]
        chosen = sel.choose(sel.scores(summed))
        sel.step_count += 1
        sent = {n for i in chosen for n in sel.layers[i]}
        sel.acc.settle(chosen, sel.layers, summed)
        # a 16-bit layer's float32 sum travels in its gradient's dtype
        out = {n: g.to(grads[n].dtype) if n in grads else g for n, g in summed.items() if n in sent}
        out.update({n: g for n, g in grads.items() if n not in sel.params})  # parameters it does not select
        return out, {n for n in summed if n not in sent}

    def end_epoch(self) -> None:
        """Tell the servers this worker completed an epoch (adaptive mode re-decides its groups on these)."""
        _require_worker("DistributedOptimizer.end_epoch()")
        self._epoch += 1
        for server in range(len(self._shards)):
            self._send(server, Header(protocol.EPOCH, {"epoch": self._epoch}), None)
