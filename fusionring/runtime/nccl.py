"""The NCCL transport: collectives of CUDA tensors on their GPU, through CuPy's binding of NCCL.

Negotiation stays on MPI; only the bytes move over NCCL. Each runtime (the global one and
one per process set) gets one NCCL communicator, created by its first collective of CUDA
tensors. Every rank of the set reaches that collective in the same order, so creating the
communicator there is collective: rank 0 makes NCCL's unique id and broadcasts it over
the runtime's MPI communicator (mpi4py).

The reduction runs on a CUDA stream of the transport's own. That stream first waits, on the
device, for the event recorded on the producer's stream when each tensor was submitted, so
the training stream and the communication stream overlap as torch expects. The host then
waits for the batch's own finish event only, never for the whole device.
"""
from __future__ import annotations

import functools
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..exceptions import FusionRingError
from .compressed_ring import compressed_allreduce

# The core's op codes (fusionring.ops) -> CuPy's NCCL constant names.
_OPS = {0: "NCCL_SUM", 1: "NCCL_MIN", 2: "NCCL_MAX", 3: "NCCL_PROD"}
# Every dtype NCCL reduces natively. Others (bool, int16, complex before its real view)
# travel through host memory as before.
_TYPES = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
          torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
          torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8", torch.int32: "NCCL_INT32",
          torch.int64: "NCCL_INT64"}
# Host-side naps while a batch's finish event is pending: short first (most batches finish
# within tens of microseconds on the device), then longer, so a slow peer costs no core.
_FIRST_NAP_S, _LONGEST_NAP_S = 20e-6, 1e-3

DEVICE = "cuda"  # TensorSpec.device of a collective that this transport carries


@functools.lru_cache(maxsize=1)
def nccl_module() -> Optional[Any]:
    """CuPy's NCCL binding (``cupy.cuda.nccl``), or None where CuPy or NCCL is missing."""
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - CuPy absent, or its CUDA libraries fail to load
        return None
    return nccl if getattr(nccl, "available", True) else None


def nccl_version() -> int:
    """NCCL's version code (e.g. 22703 for 2.27.3) where it loads, else 0."""
    nccl = nccl_module()
    if nccl is None:
        return 0
    try:
        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - a library too old to say
        return 0


def reduces_on_device(tensor: torch.Tensor, prescale: float, postscale: float,
                      mode: str) -> bool:
    """Whether an allreduce of `tensor` runs on its GPU (True) or through host memory.

    Decided from facts every rank shares for a correct program (the tensor's device and
    dtype, the scales, the setting, whether NCCL loads); where ranks differ, the negotiation
    names the mismatch. `mode` is the ``nccl`` setting: on requires NCCL, off never uses it.
    """
    if not moves_on_device(tensor, mode):
        return False
    if tensor.dtype not in _TYPES:
        return False
    # Integer tensors that must be scaled keep the host path's rounding of the scaled values.
    return tensor.is_floating_point() or (prescale == 1.0 and postscale == 1.0)


def moves_on_device(tensor: torch.Tensor, mode: str) -> bool:
    """Whether a collective that only moves `tensor`'s bytes (broadcast, allgather, alltoall)
    runs on its GPU; any dtype does. `mode` as for reduces_on_device."""
    if not tensor.is_cuda or mode == "off":
        return False
    if nccl_module() is None:
        if mode == "on":
            raise ValueError("FUSIONRING_NCCL=on, but CuPy's NCCL binding does not load here; "
                             "install it with pip install \"fusionring[gpu]\"")
        return False
    return True


def ready_event(tensor: torch.Tensor) -> "torch.cuda.Event":
    """An event on the stream that produced `tensor`, for the transport's stream to wait on."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class NcclTransport:
    """One runtime's NCCL communicator, its CUDA stream and its fusion buffers.

    `mpi_comm` is the runtime's mpi4py communicator (for the unique id and the check that
    no two ranks share a GPU); `stall_shutdown_s`, when set, bounds how long a batch may
    wait for its peers before the communicator is aborted and the batch fails.
    """

    def __init__(self, mpi_comm: Any, rank: int, size: int,
                 stall_shutdown_s: Optional[float] = None) -> None:
        self._mpi = mpi_comm
        self.rank, self.size = rank, size
        self._stall_shutdown_s = stall_shutdown_s
        self._comm: Optional[Any] = None
        self.device: Optional[torch.device] = None
        self.stream: Optional["torch.cuda.Stream"] = None
        self._buffers: Dict[torch.dtype, torch.Tensor] = {}
        self._failure: Optional[str] = None

    # ------------------------------------------------------------------ setup
    def _connect(self, device: torch.device) -> None:
        """Create the communicator on `device` (collective over the runtime's ranks)."""
        if self._failure is not None:
            raise FusionRingError(self._failure)
        if self._comm is not None:
            if device != self.device:
                raise ValueError(f"a CUDA tensor on {device}, but this rank reduces on "
                                 f"{self.device}: NCCL takes one GPU per rank")
            return
        nccl = nccl_module()
        # Every rank learns every rank's GPU, so all of them refuse a shared GPU alike
        # (NCCL itself fails there with a less helpful message, on some ranks only).
        who = self._mpi.allgather((socket.gethostname(), _gpu_identity(device)))
        owners: Dict[tuple, List[int]] = {}
        for r, key in enumerate(who):
            if key[1] is not None:
                owners.setdefault(key, []).append(r)
        shared = [ranks for ranks in owners.values() if len(ranks) > 1]
        if shared:
            host = who[shared[0][0]][0]
            raise ValueError(
                f"ranks {shared[0]} all use the same GPU on {host}; NCCL needs one GPU per "
                f"rank: call torch.cuda.set_device(hvd.local_rank()) before creating CUDA "
                f"tensors, or set FUSIONRING_NCCL=off to reduce through host memory")
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = self._mpi.bcast(unique_id, root=0)
        import cupy

        with cupy.cuda.Device(device.index):
            try:
                self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
            except nccl.NcclError as exc:
                raise FusionRingError(f"NCCL could not create a communicator of {self.size} "
                                      f"ranks on {device} (rank {self.rank}): {exc}") from exc
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def close(self) -> None:
        """Free the communicator (local; peers free theirs when they shut down)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - CUDA may be torn down at exit already
                pass

    # ------------------------------------------------------------------ reduction
    def _fusion_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        # Allocated while the transport's stream is current, so the caching allocator keeps
        # it for that stream.
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 1024), dtype=dtype, device=self.device)
            self._buffers[dtype] = buffer
        return buffer[:numel]

    def on_stream(self, device: torch.device, ready: Sequence[Optional[Any]],
                  work: Callable[[], Any], describe: Callable[[], str] = lambda: "a batch"):
        """Run `work` with the transport's stream current on `device`, after the `ready`
        events (None: nothing to wait for); return its result once the device has done it.

        Everything `work` launches (torch ops, the codec's kernels, NCCL calls) is ordered on
        that stream; the host then waits for this batch's finish event only.
        """
        self._connect(device)
        stream = self.stream
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for event in ready:
                if event is not None:
                    stream.wait_event(event)
            result = work()
            finished = torch.cuda.Event()
            finished.record(stream)
        self._wait(finished, describe)
        return result

    def allreduce(self, outputs: Sequence[torch.Tensor], ready: Sequence[Optional[Any]],
                  core_op: int, prescale: float, postscale: float,
                  contiguous: Optional[torch.Tensor] = None,
                  describe: Callable[[], str] = lambda: "a batch") -> Dict[str, float]:
        """Reduce `outputs` (CUDA tensors of one dtype, each contiguous) in place with NCCL's
        allreduce.

        `ready`: each output's producer event (None: nothing to wait for); `contiguous`: the
        outputs as one tensor when they lie back to back (no pack or unpack then). Returns
        the device's own timing of the batch in milliseconds ({"gpu_ms": ...}).
        """
        nccl = nccl_module()
        dtype = outputs[0].dtype
        copies = len(outputs) > 1 and contiguous is None

        def work():
            stream = self.stream
            started = torch.cuda.Event(enable_timing=True)
            finished = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            if len(outputs) == 1:
                buffer = outputs[0].view(-1)
            elif contiguous is not None:
                buffer = contiguous.view(-1)
            else:
                buffer = self._fusion_buffer(dtype, sum(o.numel() for o in outputs))
                torch.cat([o.view(-1) for o in outputs], out=buffer)
            if prescale != 1.0:
                buffer.mul_(prescale)
            try:
                self._comm.allReduce(buffer.data_ptr(), buffer.data_ptr(), buffer.numel(),
                                     getattr(nccl, _TYPES[dtype]),
                                     getattr(nccl, _OPS[core_op]), stream.cuda_stream)
            except nccl.NcclError as exc:
                raise FusionRingError(f"NCCL allreduce of {describe()} failed on rank "
                                      f"{self.rank}: {exc}") from exc
            if postscale != 1.0:
                buffer.mul_(postscale)
            if copies:
                pieces = torch.split(buffer, [o.numel() for o in outputs])
                for output, piece in zip(outputs, pieces):
                    output.view(-1).copy_(piece)
            finished.record(stream)
            return started, finished

        started, finished = self.on_stream(outputs[0].device, ready, work, describe)
        return {"gpu_ms": started.elapsed_time(finished)}

    def sum_in_place(self, tensor: torch.Tensor) -> None:
        """NCCL's allreduce (sum) of contiguous `tensor` in place, on the transport's stream.
        Called inside on_stream(), as a compressor's summable payload is."""
        nccl = nccl_module()
        if tensor.dtype not in _TYPES:
            raise ValueError(f"NCCL cannot sum {tensor.dtype} tensors")
        self._comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                             getattr(nccl, _TYPES[tensor.dtype]), nccl.NCCL_SUM,
                             self.stream.cuda_stream)

    def broadcast_bytes(self, data: torch.Tensor, root: int) -> None:
        """Root's bytes into `data` (uint8) on every rank. Inside on_stream()."""
        nccl = nccl_module()
        if data.numel():
            self._comm.bcast(data.data_ptr(), data.numel(), nccl.NCCL_UINT8, root,
                             self.stream.cuda_stream)

    def exchange(self, sends: Dict[int, torch.Tensor], recvs: Dict[int, torch.Tensor]) -> None:
        """Send each uint8 tensor of `sends` to its rank and receive each of `recvs` from its
        rank, all in one group call (empty ones are skipped: both sides know the sizes).
        Inside on_stream()."""
        nccl = nccl_module()
        stream = self.stream.cuda_stream
        nccl.groupStart()
        try:
            for peer in sorted(set(sends) | set(recvs)):
                send, recv = sends.get(peer), recvs.get(peer)
                if send is not None and send.numel():
                    self._comm.send(send.data_ptr(), send.numel(), nccl.NCCL_UINT8, peer, stream)
                if recv is not None and recv.numel():
                    self._comm.recv(recv.data_ptr(), recv.numel(), nccl.NCCL_UINT8, peer, stream)
        finally:
            nccl.groupEnd()

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor, core_op: int) -> None:
        """NCCL's reduce-scatter of contiguous `send` into `recv` (its equal block), by the
        core's op code. Inside on_stream()."""
        nccl = nccl_module()
        if recv.numel():
            self._comm.reduceScatter(send.data_ptr(), recv.data_ptr(), recv.numel(),
                                     getattr(nccl, _TYPES[send.dtype]),
                                     getattr(nccl, _OPS[core_op]), self.stream.cuda_stream)

    def ring(self, buffer: torch.Tensor, codec: Any, residual: Optional[torch.Tensor],
             prescale: float, postscale: float) -> Dict[str, int]:
        """The compressed ring (runtime/compressed_ring.py) on `buffer`'s GPU: each hop an
        ncclSend/ncclRecv pair in one group call, the codec's kernels between hops. Called
        inside on_stream(), so all of it is ordered on the transport's stream."""
        nccl = nccl_module()
        comm, stream = self._comm, self.stream.cuda_stream
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size

        def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
            nccl.groupStart()
            try:
                comm.send(send.data_ptr(), send.numel(), nccl.NCCL_UINT8, right, stream)
                comm.recv(recv.data_ptr(), recv.numel(), nccl.NCCL_UINT8, left, stream)
            finally:
                nccl.groupEnd()

        return compressed_allreduce(buffer, codec, exchange, self.rank, self.size,
                                    residual=residual, prescale=prescale, postscale=postscale)

    def _wait(self, event: "torch.cuda.Event", describe: Callable[[], str]) -> None:
        """Wait on the host for `event`, napping. NCCL's asynchronous errors (a peer's
        connection lost) and, when set, the stall limit abort the communicator and fail the
        batch, and every later GPU batch of this runtime, instead of waiting for ever."""
        nccl = nccl_module()
        nap = _FIRST_NAP_S
        started = time.monotonic()
        while not event.query():
            failure = None
            if nap >= _LONGEST_NAP_S:  # polled every millisecond once the batch is slow
                try:
                    self._comm.check_async_error()
                except nccl.NcclError as exc:
                    failure = f"NCCL failed during {describe()} on rank {self.rank}: {exc}"
            if (failure is None and self._stall_shutdown_s is not None
                    and time.monotonic() - started > self._stall_shutdown_s):
                failure = (f"NCCL collective {describe()} did not finish within "
                           f"{self._stall_shutdown_s:g} s on rank {self.rank}: a peer stopped "
                           f"taking part")
            if failure is not None:
                self._failure = failure + "; the NCCL communicator was aborted"
                comm, self._comm = self._comm, None
                try:
                    comm.abort()
                except Exception:  # noqa: BLE001 - the failure below is what matters
                    pass
                raise FusionRingError(self._failure)
            time.sleep(nap)
            nap = min(nap * 2, _LONGEST_NAP_S)


def _gpu_identity(device: torch.device) -> Optional[str]:
    """The GPU's UUID, which tells two ranks' GPUs apart on one host whatever each rank's
    CUDA_VISIBLE_DEVICES (None where torch does not know it: NCCL then checks alone)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return str(uuid) if uuid is not None else None
