"""Horovod-compatible collective functions on torch tensors.

Each call builds runtime requests and returns a handle (async) or the result. The
background loop does the work; these functions only prepare buffers and finish results
(copy back, move to the original device) in the caller's thread.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import numbers
import pickle
import threading
import time
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set,
                    Tuple, Union)

import cloudpickle
import torch

from .. import state as _rt  # the routed runtime: _rt.get(), _rt.using(), init, shutdown
from ..dtypes import check_dtype, complex_result, dtype_name, real_view
from ..compression import Compression, capabilities, describe, resolve_compressor
from ..compression.base import check_floating, compress_named
from ..negotiation import AUTO_NAME_MARK, TensorSpec
from ..runtime import Request
from ..runtime.nccl import (DEVICE, moves_on_device, nccl_version, reduces_on_device,
                             ready_event)
from ..process_sets import ProcessSet, register_at_init, runtime_for
from ..ops import ReduceOp, core_reduction, resolve_op
from .threads import fit_intra_op_threads

Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


# ---------------------------------------------------------------------- process state
def init(comm=None, process_sets=None) -> None:
    """Initialise fusionring (call once per process, on every rank).

    `comm`: None (every rank), an mpi4py communicator, a list of global ranks, or a list of
    communicators: the first is the global one, each other one a process set.
    `process_sets`: ProcessSets (from lists of ranks or communicators) or lists of ranks to
    register now; a rank may name sets the others do not (see ``register_at_init``).
    "dynamic" is accepted for Horovod compatibility (sets can always be added later).
    """
    if isinstance(comm, (list, tuple)) and comm and hasattr(comm[0], "Get_group"):
        comm, more = comm[0], [ProcessSet(c) for c in comm[1:]]
        process_sets = more + ([] if process_sets in (None, "dynamic") else list(process_sets))
    fresh = not _rt.is_initialized()
    runtime = _rt.init(comm)
    if fresh:
        fit_intra_op_threads(runtime)
    if process_sets is not None and not isinstance(process_sets, str):
        register_at_init(process_sets)


def shutdown() -> None:
    """Stop fusionring on this rank."""
    _rt.shutdown()


def is_initialized() -> bool:
    return _rt.is_initialized()


def size() -> int:
    """Number of ranks."""
    return _rt.get("size()").size


def rank() -> int:
    """This process's rank, 0 <= rank < size()."""
    return _rt.get("rank()").rank


def local_size() -> int:
    """Number of ranks on this node."""
    return _rt.get("local_size()").local_size


def local_rank() -> int:
    """This process's rank among the ranks of its node."""
    return _rt.get("local_rank()").local_rank


def cross_size() -> int:
    """Number of nodes (ranks sharing this one's local rank)."""
    return _rt.get("cross_size()").cross_size


def cross_rank() -> int:
    """This node's index among the nodes."""
    return _rt.get("cross_rank()").cross_rank


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    r = _rt.get("is_homogeneous()")
    return r.size == r.local_size * r.cross_size


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE."""
    _rt.get("mpi_threads_supported()")
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """NCCL's version code (e.g. 22703) where CuPy's NCCL binding loads (``pip install
    "fusionring[gpu]"``), so that CUDA tensors are reduced on the GPU; 0 where it does not."""
    return nccl_version()


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether the core was built with its CUDA kernels (N:M on the GPU)."""
    from .. import _C

    return bool(getattr(_C, "nm_cuda_built", False))


def communication_stats() -> Dict[str, Any]:
    """Counters of this rank's runtime: cycles, fused batches, bytes reduced and sent."""
    return _rt.get("communication_stats()").stats.as_dict()


# ---------------------------------------------------------------------- handles
@dataclasses.dataclass
class _Operation:
    handles: List[int]
    finish: Callable[[List[Request]], Any]
    runtime: Any = None  # the runtime the handles belong to (a process set's, or global)


_operations: Dict[int, _Operation] = {}
_operation_ids = itertools.count()
# Unnamed operations are numbered per process set (by its global ranks; () is the global
# set), so ranks that share one set agree on its names whatever they run on other sets.
_auto_names: Dict[Tuple[int, ...], Iterator[int]] = {}
# broadcast_object's own counts, one per process set (by its ranks), so an unnamed operation
# that one rank skipped (one that failed elsewhere while it had joined), or a broadcast within
# a set this rank is not in, does not shift its names.
_object_broadcasts: Dict[Tuple[int, ...], Iterator[int]] = {}
_handles_lock = threading.Lock()


def _register(handles: List[int], finish: Callable[[List[Request]], Any]) -> int:
    runtime = _rt.get("a collective operation")
    with _handles_lock:
        handle = next(_operation_ids)
        _operations[handle] = _Operation(handles, finish, runtime)
    return handle


def _keeps_runtime(cls):
    """Run an autograd Function's backward on the runtime its forward ran on (a process
    set's), since autograd calls backward outside the forward's context."""
    forward, backward = cls.forward, cls.backward

    def forward_here(ctx, *args):
        ctx.fusionring_runtime = _rt.current()
        return forward(ctx, *args)

    def backward_there(ctx, *grads):
        with _rt.using(ctx.fusionring_runtime):
            return backward(ctx, *grads)

    cls.forward, cls.backward = staticmethod(forward_here), staticmethod(backward_there)
    return cls


def _global_rank() -> int:
    """This process's global rank, also inside a process set's operation."""
    runtime = _rt.get("rank()")
    return runtime.global_ranks[runtime.rank] if runtime.global_ranks else runtime.rank


def _routed(function):
    """Run `function` on the runtime of its `process_set` argument (global when None)."""
    # Found by position once: every gradient submission passes through here.
    position = list(inspect.signature(function).parameters).index("process_set")

    @functools.wraps(function)
    def call(*args, **kwargs):
        process_set = args[position] if len(args) > position else kwargs.get("process_set")
        runtime = runtime_for(process_set, f"{function.__name__}()")
        if runtime is None:
            return function(*args, **kwargs)
        with _rt.using(runtime):
            return function(*args, **kwargs)

    return call


def _lookup(handle: int) -> _Operation:
    with _handles_lock:
        operation = _operations.get(handle) if isinstance(handle, int) else None
    if operation is None:
        raise ValueError(f"unknown handle {handle!r}: it was not returned by an async operation "
                         f"or has already been synchronized")
    return operation


def poll(handle: int) -> bool:
    """True when the asynchronous operation behind `handle` has completed."""
    _rt.get("poll()")
    operation = _lookup(handle)
    return all(operation.runtime.poll(h) for h in operation.handles)


def synchronize(handle: int):
    """Wait for an asynchronous operation and return its result (raises on failure).

    As in Horovod, a handle that is not pending (already synchronized, or never returned by
    an asynchronous operation) returns None.
    """
    _rt.get("synchronize()")
    with _handles_lock:  # taken out at once: of two threads synchronizing it, one waits
        operation = _operations.pop(handle, None) if isinstance(handle, int) else None
    if operation is None:
        return None
    runtime = operation.runtime
    requests, error = [], None
    for h in operation.handles:  # wait for all, even after a failure, to release them
        try:
            requests.append(runtime.wait(h))
        except BaseException as exc:  # noqa: BLE001
            error = error or exc
    if error is not None:
        raise error
    return operation.finish(requests)


# ---------------------------------------------------------------------- request building
def _auto_number(counts: Dict[Tuple[int, ...], Iterator[int]] = _auto_names) -> int:
    """The next number from `counts` for an unnamed operation on the routed process set."""
    runtime = _rt.current()
    ranks = tuple(runtime.global_ranks) if runtime is not None and runtime.global_ranks else ()
    return next(counts.setdefault(ranks, itertools.count()))


def _full_name(kind: str, name: Optional[str]) -> str:
    if name is None:
        return f"{kind}{AUTO_NAME_MARK}{_auto_number()}"
    return f"{kind}.{name}"


def _grad_name(name: Optional[str]) -> Optional[str]:
    """The name of a backward collective: the forward's name and ".grad", so concurrent
    backward passes (threads, overlapping process sets) pair up across ranks by name rather
    than by the order they happen to run in. An unnamed forward gets an unnamed backward."""
    return None if name is None else f"{name}.grad"


def _requests(kind: str, names: Sequence[Optional[str]],
              build: Callable[[int, str], Request]) -> List[Request]:
    """`build(i, full_name)` for each of `names` (None: unnamed), one operation's requests.

    Bad input (a ValueError, TypeError or NotImplementedError from `build`) is raised to
    the caller at once, as always, and also told to the other ranks: their matching
    operation fails naming this rank and the error, instead of waiting for a tensor this
    rank will never send. Every name is drawn first, so a refused unnamed operation moves
    the unnamed count on as it does on the ranks that ran it.
    """
    fulls = [_full_name(kind, name) for name in names]
    try:
        return [build(i, full) for i, full in enumerate(fulls)]
    except _REFUSALS as exc:
        _refuse(kind, fulls, exc)
        raise


# What a request builder raises for bad input (see _requests).
_REFUSALS = (ValueError, TypeError, NotImplementedError)


def _refuse(kind: str, fulls: List[str], exc: BaseException) -> None:
    # The runtime the builder used (a process set's, within the caller's routing).
    _rt.get(kind).refuse(fulls, kind, f"{type(exc).__name__}: {exc}")


def _check_gpu(tensor: torch.Tensor, name: str, runtime) -> None:
    """A CUDA tensor must lie on the GPU this rank's NCCL collectives run on: refused here,
    on the caller's rank, rather than hanging its peers inside NCCL."""
    gpu = runtime.gpu
    if gpu is not None and tensor.device != gpu:
        raise ValueError(f"tensor '{name}' is on {tensor.device}, but this rank's collectives "
                         f"run on {gpu}: NCCL takes one GPU per rank (torch.cuda.set_device("
                         f"hvd.local_rank()) before creating tensors)")


def _host(tensor: torch.Tensor, name: str, reduced: bool = True,
          on_device: bool = False) -> torch.Tensor:
    """A contiguous CPU tensor holding the data (device tensors are staged through host),
    or with `on_device` a contiguous tensor on the device where `tensor` lies.

    `reduced`: the core combines the values, so the dtype must be one it reduces (a complex
    tensor is returned as its real view); data that is only moved (broadcast, allgather,
    alltoall) travels as bytes, any dtype (bool masks and int8 buffers in a state_dict).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor, not {type(tensor).__name__}")
    if reduced:
        check_dtype(tensor, name)
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor '{name}' is sparse; convert it with .to_dense() first")
    if (tensor.is_cpu or on_device) and tensor.is_contiguous():  # skip the no-op copies
        host = tensor.detach()
    elif on_device:
        host = tensor.detach().contiguous()
    else:
        host = tensor.detach().to("cpu").contiguous()
    return real_view(host) if reduced else host


def _moves_on_gpu(tensor: Any, runtime, name: str) -> bool:
    """Whether a collective that only moves `tensor`'s bytes runs on its GPU over NCCL."""
    on_device = (isinstance(tensor, torch.Tensor) and tensor.is_cuda
                 and moves_on_device(tensor, runtime.config.nccl))
    if on_device:
        _check_gpu(tensor, name, runtime)
    return on_device


def _check_complex_op(tensor: torch.Tensor, op: ReduceOp, kind: str, name: Optional[str]) -> None:
    # Summing the parts is summing the numbers; an order or a product of them is not partwise.
    if tensor.is_complex() and op not in (ReduceOp.Sum, ReduceOp.Average):
        raise ValueError(f"{_described(kind, name)}: op={op.name} is not defined for complex "
                         f"tensors ({dtype_name(tensor.dtype)}); use Sum or Average")


def _shares_memory(host: torch.Tensor, tensor: torch.Tensor) -> bool:
    return host.device == tensor.device and host.data_ptr() == tensor.data_ptr()


# One instance per compressor class given as ``compression=`` (see _compressor).
_built_compressors: Dict[type, Any] = {}


def _compressor(compression: Any) -> Any:
    """`compression` ready to call: a class with instance methods is built once per process
    (``resolve_compressor``), so a stateful one keeps its state from call to call."""
    if not isinstance(compression, type):
        return compression
    built = _built_compressors.get(compression)
    if built is None:
        built = _built_compressors[compression] = resolve_compressor(compression)
    return built


# What a plain allreduce (a CPU tensor, a reducible real dtype, no compressor, not Adasum)
# resolves to, by (dtype, shape, op, prescale, postscale, world size): (spec, core op,
# core prescale, core postscale). A gradient is reduced with the same arguments every step,
# and every check behind an entry depends only on its key.
_plain_allreduces: Dict[tuple, Tuple[TensorSpec, int, float, float]] = {}


def _allreduce_request(tensor: torch.Tensor, name: Optional[str], full: str, op, average,
                       prescale_factor: float, postscale_factor: float,
                       in_place: bool, compression=None) -> Request:
    runtime = _rt.get("allreduce")
    key = None
    if (compression is None and average is None and isinstance(tensor, torch.Tensor)
            and tensor.is_cpu and tensor.layout is torch.strided and tensor.is_contiguous()
            and type(prescale_factor) is float and type(postscale_factor) is float):
        key = (tensor.dtype, tensor.shape, op, prescale_factor, postscale_factor, runtime.size)
        plain = _plain_allreduces.get(key)
        if plain is not None:  # every gradient of every step after the first comes this way
            spec, core_op, pre, post = plain
            host = tensor.detach() if tensor.requires_grad else tensor
            return Request(full, spec, host, host if in_place else host.clone(),
                           core_op=core_op, prescale=pre, postscale=post)
    reduce_op = resolve_op(op, average)
    core_op, pre, post = core_reduction(reduce_op, prescale_factor, postscale_factor, runtime.size)
    # Compressors that reduce inside the runtime (their own collective on the fused
    # buffer) travel with the request; Horovod-style ones were applied by the caller.
    compression = _compressor(compression) if compression is not None else None
    caps = capabilities(compression) if compression is not None else None
    in_runtime = caps is not None and caps.in_runtime
    if in_runtime and not tensor.is_complex():  # complex: as its real and imaginary parts
        # Its ring encodes float32: an integer tensor would come back rounded.
        check_floating(f"allreduce: {describe(compression)}", tensor, name or full)
    # A CUDA tensor is reduced on its GPU over NCCL (Adasum too), unless it goes through a
    # compressor that keeps its work on the host: those are staged through host memory.
    on_device = (isinstance(tensor, torch.Tensor) and tensor.is_cuda
                 and (reduce_op != ReduceOp.Adasum or tensor.is_floating_point())
                 and (not in_runtime or compression.reduces_on_gpu(tensor))
                 and reduces_on_device(tensor, pre, post, runtime.config.nccl))
    if on_device:
        _check_gpu(tensor, name or full, runtime)
    host = _host(tensor, name or full, on_device=on_device)
    _check_complex_op(tensor, reduce_op, "allreduce", name or full)
    if reduce_op == ReduceOp.Adasum:
        _check_adasum(tensor, name or full, runtime.size, compression)
    output = host if in_place or not _shares_memory(host, tensor) else host.clone()
    spec = _allreduce_spec(tensor.dtype, tuple(tensor.shape), reduce_op, float(prescale_factor),
                           float(postscale_factor), caps.name if in_runtime else "",
                           DEVICE if on_device else "")
    if (key is not None and reduce_op != ReduceOp.Adasum and not tensor.is_complex()
            and isinstance(op, (ReduceOp, type(None)))):
        if len(_plain_allreduces) >= 4096:  # shapes that never repeat: start again
            _plain_allreduces.clear()
        _plain_allreduces[key] = (spec, core_op, pre, post)
    return Request(full, spec, host, output, core_op=core_op, prescale=pre, postscale=post,
                   communicator=compression.communicate if in_runtime else None,
                   ready_event=ready_event(host) if on_device else None)


@functools.lru_cache(maxsize=4096)
def _allreduce_spec(dtype: torch.dtype, shape: Tuple[int, ...], op: ReduceOp, prescale: float,
                    postscale: float, compression: str, device: str = "") -> TensorSpec:
    # One shared object per distinct spec: a gradient's spec is the same every step, and
    # the negotiation compares specs by identity first.
    return TensorSpec("allreduce", dtype_name(dtype), shape, op=op.name, prescale=prescale,
                      postscale=postscale, compression=compression, device=device)


def _check_adasum(tensor: torch.Tensor, name: str, size_: int, compression) -> None:
    # The same facts on every rank, so every rank raises alike and nothing is sent.
    if size_ & (size_ - 1):   # NotImplementedError, as in Horovod
        raise NotImplementedError(f"allreduce '{name}': op=Adasum needs a power-of-two number "
                                  f"of ranks, not {size_} (Running Adasum with non-power of 2 "
                                  f"ranks is not supported yet)")
    if not tensor.is_floating_point():
        raise ValueError(f"allreduce '{name}': op=Adasum needs a floating-point tensor, not "
                         f"{dtype_name(tensor.dtype)}")
    if compression is not None and capabilities(compression).in_runtime:
        raise ValueError(f"allreduce '{name}': op=Adasum cannot be combined with "
                         f"{describe(compression)} compression")


def _submit(requests: List[Request]) -> List[int]:
    runtime = _rt.get("a collective operation")
    burst = _rt.in_burst()
    if len(requests) > 1:  # a group: negotiated and fused together, queued all or none
        return runtime.submit_group(requests, burst=burst)
    handles = []
    try:
        for request in requests:
            handles.append(runtime.submit(request, burst=burst))
    except BaseException:
        for h in handles:  # a later name clashed: do not leave earlier ones unowned
            try:
                runtime.wait(h)
            except BaseException:  # noqa: BLE001
                pass
        raise
    return handles


def _finish_into(targets: Sequence[Optional[torch.Tensor]], single: bool):
    """Result finisher: copy into the user's tensors for in-place ops, else return outputs."""

    def finish(requests: List[Request]):
        results = []
        for request, target in zip(requests, targets):
            out = complex_result(request.spec, request.output)
            if target is not None:
                if out.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(out)
                out = target
            results.append(out)
        return results[0] if single else results

    return finish


def _outputs_on(devices: Sequence[torch.device], single: bool):
    """Result finisher: each request's output, moved back to its input's device."""

    def finish(requests: List[Request]):
        outputs = [complex_result(r.spec, r.output) for r in requests]
        outputs = [o.to(d) if d.type != "cpu" else o for o, d in zip(outputs, devices)]
        return outputs[0] if single else outputs

    return finish


# ---------------------------------------------------------------------- allreduce
@_routed
def allreduce_async(tensor: torch.Tensor, average=None, name: Optional[str] = None, op=None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set=None) -> int:
    """Start an allreduce of `tensor` into a new tensor; returns a handle."""
    requests = _requests("allreduce", [name], lambda _, full: _allreduce_request(
        tensor, name, full, op, average, prescale_factor, postscale_factor, in_place=False))
    return _register(_submit(requests), _outputs_on([tensor.device], single=True))


@_routed
def allreduce_async_(tensor: torch.Tensor, average=None, name: Optional[str] = None, op=None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set=None, compression=None) -> int:
    """Start an in-place allreduce of `tensor`; returns a handle.

    `compression` is only for compressors that reduce inside the runtime (``in_runtime``).
    """
    # _requests, unrolled: every gradient of every step comes this way.
    full = _full_name("allreduce", name)
    try:
        request = _allreduce_request(tensor, name, full, op, average, prescale_factor,
                                     postscale_factor, in_place=True, compression=compression)
    except _REFUSALS as exc:
        _refuse("allreduce", [full], exc)
        raise
    return _register(_submit([request]), _finish_into([tensor], single=True))


def allreduce_many_async_(tensors: Sequence[torch.Tensor], names: Sequence[str], op=None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0
                          ) -> Tuple[List[int], Optional[BaseException]]:
    """Start an in-place allreduce of each of `tensors` under its name in `names` on the
    routed runtime, as that many allreduce_async_ calls would (each negotiated and waited
    for on its own), queued at once: the gradients of a backward pass.

    Returns the handles of those started and, when one was refused (bad input, told to the
    other ranks as allreduce_async_ does, or a name in flight), its error: the ones before it
    are started, the rest are not, and the caller raises it once it has kept the handles.
    """
    requests: List[Request] = []
    error = None
    for tensor, name in zip(tensors, names):
        full = _full_name("allreduce", name)
        try:
            requests.append(_allreduce_request(tensor, name, full, op, None, prescale_factor,
                                               postscale_factor, in_place=True))
        except _REFUSALS as exc:
            _refuse("allreduce", [full], exc)
            error = exc
            break
    if not requests:
        return [], error
    handles, in_flight = _rt.get("allreduce").submit_many(requests, burst=_rt.in_burst())
    return [_register([h], _finish_into([t], single=True))
            for h, t in zip(handles, tensors)], in_flight or error


def _needs_grad(tensor: torch.Tensor) -> bool:
    """Whether a blocking collective must go through its autograd function: without a
    gradient to carry, autograd's bookkeeping is only cost (about 15 us a call)."""
    # Anything else goes the plain way, where a non-tensor is refused naming the argument.
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


@_keeps_runtime
class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.name, ctx.op, ctx.scales = name, op, (prescale_factor, postscale_factor)
        return synchronize(allreduce_async(tensor, name=name, op=op,
                                           prescale_factor=prescale_factor,
                                           postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        # Through the differentiable allreduce: under create_graph=True the second-order
        # graph runs through the collective too, as in Horovod.
        reduced = allreduce(grad_output.contiguous(), name=_grad_name(ctx.name), op=ctx.op,
                            prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1])
        return reduced, None, None, None, None


@_routed
def allreduce(tensor: torch.Tensor, average=None, name: Optional[str] = None,
              compression=Compression.none, op=None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set=None) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return the result (differentiable).

    op: Average (default), Sum, Min, Max or Product. `compression` encodes the tensor
    for the wire (Compression.fp16 sends float16).
    """
    try:
        reduce_op = resolve_op(op, average)
        compression = _compressor(compression)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{_described('allreduce', name)}: the tensor must be a torch.Tensor, "
                            f"not {type(tensor).__name__}")
        in_runtime = capabilities(compression).in_runtime
        if in_runtime and not tensor.is_complex():  # here the other ranks hear of it at once
            check_floating(f"allreduce: {describe(compression)}", tensor, name)
        if not in_runtime:
            started = time.perf_counter()
            tensor_compressed, ctx = compress_named(compression, tensor, name)
            trace_compression(compression, name, "compress", started)
            check_summable(compression, tensor_compressed, name)
    except _REFUSALS as exc:
        # Refused under the name the other ranks submit, so they fail at once, not at a stall.
        _refuse("allreduce", [_full_name("allreduce", name)], exc)
        raise
    if in_runtime:  # e.g. Compression.nm: reduced in the runtime
        return synchronize(allreduce_async_(tensor.detach().clone(), name=name, op=reduce_op,
                                            prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor,
                                            compression=compression))
    if isinstance(tensor_compressed, torch.Tensor):
        if _needs_grad(tensor_compressed):
            summed = _AllreduceFunction.apply(tensor_compressed, name, reduce_op,
                                              prescale_factor, postscale_factor)
        else:
            summed = synchronize(allreduce_async(tensor_compressed, name=name, op=reduce_op,
                                                 prescale_factor=prescale_factor,
                                                 postscale_factor=postscale_factor))
        started = time.perf_counter()
        result = compression.decompress(summed, ctx)
        trace_compression(compression, name, "decompress", started)
        return result
    return _compressed_allreduce(tensor_compressed, ctx, compression, name, reduce_op,
                                 prescale_factor, postscale_factor)


def trace_compression(compression, name: Optional[str], phase: str, started: float,
                      runtime=None) -> None:
    """Put a caller-side compress or decompress of tensor `name`, begun at `started`
    (time.perf_counter), on the timeline beside its reduction, when one records.
    `runtime`: the one the tensor is reduced on (default: where operations are routed)."""
    caps = capabilities(compression)
    if caps.identity or caps.in_runtime:
        return  # nothing happened here; in-runtime compressors record their own phases
    runtime = runtime or _rt.routed()
    if runtime is not None:  # records nothing unless a timeline is being written
        runtime.record_span(f"allreduce.{name}" if name is not None else "allreduce (unnamed)",
                            phase, started, time.perf_counter())


def check_summable(compression, payload, name: Optional[str]) -> None:
    """Refuse a payload that a summing allreduce would corrupt, on every rank alike (the
    compressor and its payload's structure are the same everywhere).

    A payload of several parts is summed part by part only when its compressor declares
    ``summable = True``: a part holding indices or a codebook would be summed silently. A
    single tensor is summed unless the compressor declares ``summable = False``."""
    caps = capabilities(compression)
    if caps.summable is True:
        return
    what = f"allreduce '{name}'" if name is not None else "allreduce"
    if caps.summable is False:
        raise ValueError(f"{what}: the {describe(compression)} compressor declares its payload "
                         f"not summable (summable = False), so it cannot go through a summing "
                         f"allreduce; reduce it inside the runtime (in_runtime) or allgather it")
    if not isinstance(payload, torch.Tensor):
        parts = (", ".join(type(p).__name__ if not isinstance(p, torch.Tensor)
                           else f"{dtype_name(p.dtype)} tensor" for p in payload)
                 if isinstance(payload, (tuple, list)) else type(payload).__name__)
        raise ValueError(f"{what}: the {describe(compression)} compressor returned a payload "
                         f"of several parts ({parts}); an allreduce sums every part, which is "
                         f"only right for summable encodings (not indices or a codebook). "
                         f"Declare summable = True on a fusionring.compression.Compressor "
                         f"subclass if the sum of payloads is the payload of the sum")


def _compressed_allreduce(payload, ctx, compression, name, reduce_op, prescale, postscale):
    """Compressors whose payload is several summable parts reduce each part."""
    parts = list(payload)
    base = name if name is not None else f"compressed{AUTO_NAME_MARK}{_auto_number()}"
    reduced = grouped_allreduce(parts, name=base, op=reduce_op, prescale_factor=prescale,
                                postscale_factor=postscale)
    started = time.perf_counter()
    result = compression.decompress(type(payload)(reduced) if isinstance(payload, tuple)
                                    else reduced, ctx)
    trace_compression(compression, name, "decompress", started)
    return result


@_routed
def allreduce_(tensor: torch.Tensor, average=None, name: Optional[str] = None, op=None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set=None) -> torch.Tensor:
    """In-place allreduce; returns `tensor`."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


def _group_names(name: Optional[str], count: int) -> List[Optional[str]]:
    if name is None:
        return [None] * count
    return [f"{name}.{i}" for i in range(count)]


@_routed
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average=None,
                            name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=None) -> int:
    """Start an allreduce of several tensors as one operation; returns one handle."""
    tensors = list(tensors)
    names = _group_names(name, len(tensors))
    requests = _requests("allreduce", names, lambda i, full: _allreduce_request(
        tensors[i], names[i], full, op, average, prescale_factor, postscale_factor, False))
    return _register(_submit(requests), _outputs_on([t.device for t in tensors], single=False))


@_routed
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average=None,
                             name: Optional[str] = None, op=None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set=None,
                             compression=None) -> int:
    """Start an in-place allreduce of several tensors; returns one handle.

    `compression` is only for compressors that reduce inside the runtime (``in_runtime``).
    """
    tensors = list(tensors)
    names = _group_names(name, len(tensors))
    requests = _requests("allreduce", names, lambda i, full: _allreduce_request(
        tensors[i], names[i], full, op, average, prescale_factor, postscale_factor, True,
        compression=compression))
    return _register(_submit(requests), _finish_into(list(tensors), single=False))


@_routed
def _grouped_allreduce_named_async_(tensors: Sequence[torch.Tensor], names: Sequence[str],
                                    op=None, process_set=None, compression=None) -> int:
    """As grouped_allreduce_async_, each tensor under a name of its own (a compressor keeps
    its state per name): one group, negotiated and fused together, so the batches it makes
    are the same at every step that sends the same tensors."""
    tensors, names = list(tensors), list(names)
    requests = _requests("allreduce", names, lambda i, full: _allreduce_request(
        tensors[i], names[i], full, op, None, 1.0, 1.0, True, compression=compression))
    return _register(_submit(requests), _finish_into(list(tensors), single=False))


@_keeps_runtime
class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, *tensors):
        ctx.name, ctx.op, ctx.scales = name, op, (prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_allreduce_async(
            tensors, name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        reduced = grouped_allreduce([g.contiguous() for g in grad_outputs],
                                    name=_grad_name(ctx.name), op=ctx.op,
                                    prescale_factor=ctx.scales[0], postscale_factor=ctx.scales[1])
        return (None, None, None, None, *reduced)


@_routed
def grouped_allreduce(tensors: Sequence[torch.Tensor], average=None, name: Optional[str] = None,
                      compression=Compression.none, op=None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=None) -> List[torch.Tensor]:
    """Allreduce several tensors together and return the results (differentiable)."""
    tensors = list(tensors)
    compression = _compressor(compression)
    if capabilities(compression).in_runtime:  # reduced in the runtime, as one group
        return synchronize(grouped_allreduce_async_(
            [t.detach().clone() for t in tensors], average, name, op, prescale_factor,
            postscale_factor, compression=compression))
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    for (payload, _), part in zip(compressed, _group_names(name, len(tensors))):
        check_summable(compression, payload, part)
    outputs = _GroupedAllreduceFunction.apply(name, resolve_op(op, average), prescale_factor,
                                              postscale_factor, *[c[0] for c in compressed])
    return [compression.decompress(o, c[1]) for o, c in zip(outputs, compressed)]


@_routed
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average=None, name: Optional[str] = None,
                       op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set=None) -> List[torch.Tensor]:
    """In-place allreduce of several tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor))


# ---------------------------------------------------------------------- allgather
def _allgather_request(tensor: torch.Tensor, name: Optional[str], full: str) -> Request:
    runtime = _rt.get("allgather")
    on_device = _moves_on_gpu(tensor, runtime, name or full)
    host = _host(tensor, name or full, reduced=False, on_device=on_device)
    if host.dim() == 0:
        host = host.reshape(1)
    spec = TensorSpec("allgather", dtype_name(tensor.dtype), tuple(host.shape),
                      device=DEVICE if on_device else "")
    return Request(full, spec, host, None, ready_event=ready_event(host) if on_device else None)


@_routed
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, process_set=None) -> int:
    """Start gathering `tensor` from all ranks, concatenated along dim 0 (sizes may differ)."""
    requests = _requests("allgather", [name],
                         lambda _, full: _allgather_request(tensor, name, full))
    return _register(_submit(requests), _outputs_on([tensor.device], single=True))


@_routed
def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str] = None, op=None,
                           process_set=None) -> int:
    """Start reducing a sparse (COO) tensor: every rank's indices and values are gathered
    and the result is their sum (divided by size() for Average), still sparse.

    The handle is callable, as Horovod's: ``handle()`` (or ``synchronize(handle)``) returns
    the reduced sparse tensor; duplicate indices are summed when it is coalesced.
    """
    reduce_op = resolve_op(op)
    label = name if name is not None else f"sparse{AUTO_NAME_MARK}{_auto_number()}"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async needs a sparse COO tensor ('{label}')")
    if reduce_op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse allreduce of '{label}' supports Average and Sum, not "
                         f"{reduce_op.name}")
    _, _, postscale = core_reduction(reduce_op, 1.0, 1.0, _rt.get("sparse_allreduce_async()").size)
    sparse = tensor.coalesce()
    # Allgather concatenates along dim 0, so indices travel as (nnz, ndim) rows.
    parts = [sparse.indices().t().contiguous(), sparse.values().contiguous()]
    names = [f"{label}.indices", f"{label}.values"]
    requests = _requests("allgather", names,
                         lambda i, full: _allgather_request(parts[i], names[i], full))

    def finish(done):
        indices, values = done[0].output, done[1].output
        if postscale != 1.0:  # Average
            values = values * postscale
        # Every rank's indices come from a coalesced tensor of this shape, so they are in
        # range; saying so explicitly also keeps torch from warning on every rank.
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape,
                                       check_invariants=False).to(tensor.device)

    return _CallableHandle(_register(_submit(requests), finish))


class _CallableHandle(int):
    """A handle that is also Horovod's sparse handle: ``handle()`` waits and returns the
    result, as ``synchronize(handle)`` does."""

    def __call__(self):
        return synchronize(self)


@_keeps_runtime
class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.name = name
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        return synchronize(allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad_output):
        # As Horovod: the output gradient averaged over the ranks (of the set), then this
        # rank's rows of it.
        name = _grad_name(ctx.name)
        dims = synchronize(allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64),
                                           name=None if name is None else f"{name}.dims"))
        reduced = allreduce(grad_output.contiguous(), name=name, op=Average)
        offset = int(dims[: _rt.get("allgather").rank].sum())
        return reduced.narrow(0, offset, ctx.dim0), None


@_routed
def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0 (differentiable)."""
    if not _needs_grad(tensor):
        return synchronize(allgather_async(tensor, name=name))
    return _AllgatherFunction.apply(tensor, name)


@_routed
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set=None) -> int:
    """Start gathering several tensors (each along dim 0) as one operation; one handle.

    synchronize(handle) returns the list of gathered tensors, in the order of `tensors`.
    """
    tensors = list(tensors)
    names = _group_names(name, len(tensors))
    requests = _requests("allgather", names,
                         lambda i, full: _allgather_request(tensors[i], names[i], full))
    return _register(_submit(requests), _outputs_on([t.device for t in tensors], single=False))


@_keeps_runtime
class _GroupedAllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *tensors):
        ctx.name, ctx.shapes = name, [t.shape for t in tensors]
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(synchronize(grouped_allgather_async(tensors, name=name)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        name = _grad_name(ctx.name)
        dims = synchronize(allgather_async(torch.tensor([ctx.dims], dtype=torch.int64),
                                           name=None if name is None else f"{name}.dims"))
        reduced = grouped_allreduce([g.contiguous() for g in grad_outputs], name=name,
                                    op=Average)
        offsets = dims[: _rt.get("grouped_allgather").rank].sum(dim=0).tolist()
        grads = [g.narrow(0, int(o), d).reshape(s)
                 for g, o, d, s in zip(reduced, offsets, ctx.dims, ctx.shapes)]
        return (None, *grads)


@_routed
def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set=None) -> List[torch.Tensor]:
    """Allgather several tensors together (dim 0 may differ per rank); differentiable."""
    tensors = list(tensors)
    if not tensors:
        return []
    return list(_GroupedAllgatherFunction.apply(name, *tensors))


# ---------------------------------------------------------------------- alltoall
def _described(kind: str, name: Optional[str]) -> str:
    """How error messages name an operation before it has a (possibly generated) name."""
    return f"{kind} '{name}'" if name is not None else f"{kind} of an unnamed tensor"


def _alltoall_splits(splits, rows: int, size: int, what: str) -> List[int]:
    """How many rows of dim 0 go to each rank; ValueError (naming the tensor) when invalid."""
    if splits is None:
        if rows % size:
            raise ValueError(f"{what}: the first dimension ({rows}) does not split evenly among "
                             f"{size} ranks; pass splits to say how many rows go to each rank")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if (splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype.is_complex
                or splits.dtype == torch.bool):
            raise ValueError(f"{what}: splits must be a 1-D integer tensor, not a "
                             f"{splits.dim()}-D {dtype_name(splits.dtype)} tensor")
        values = [int(v) for v in splits.tolist()]
    else:
        try:
            values = list(splits)
        except TypeError:
            raise ValueError(f"{what}: splits must be a list or 1-D tensor of integers, not "
                             f"{type(splits).__name__}") from None
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{what}: splits must hold integers, got {values!r}")
        values = [int(v) for v in values]
    if len(values) != size:
        raise ValueError(f"{what}: splits has {len(values)} entries; it needs one per rank "
                         f"({size})")
    if any(v < 0 for v in values):
        raise ValueError(f"{what}: splits {values} has a negative entry")
    if sum(values) != rows:
        raise ValueError(f"{what}: splits {values} sum to {sum(values)}, but the first "
                         f"dimension is {rows}")
    return values


def _alltoall_request(tensor: torch.Tensor, splits, name: Optional[str], full: str) -> Request:
    runtime = _rt.get("alltoall")
    what = _described("alltoall", name)
    on_device = _moves_on_gpu(tensor, runtime, name if name is not None else "(unnamed)")
    host = _host(tensor, name if name is not None else "(unnamed)", reduced=False,
                 on_device=on_device)
    if host.dim() == 0:
        raise ValueError(f"{what}: a 0-d tensor has no first dimension to split")
    sent = _alltoall_splits(splits, host.shape[0], runtime.size, what)
    spec = TensorSpec("alltoall", dtype_name(tensor.dtype), tuple(host.shape),
                      device=DEVICE if on_device else "")
    return Request(full, spec, host, None, payload={"splits": sent},
                   ready_event=ready_event(host) if on_device else None)


@_routed
def alltoall_async(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
                   process_set=None) -> int:
    """Start an alltoall; synchronize(handle) returns (output, received_splits).

    received_splits is int32 on the CPU, or has the dtype and device of `splits` when
    that is a tensor (as in Horovod).
    """
    requests = _requests("alltoall", [name],
                         lambda _, full: _alltoall_request(tensor, splits, name, full))
    device = tensor.device
    like = splits if isinstance(splits, torch.Tensor) else None

    def finish(requests):
        done = requests[0]
        output = done.output.to(device) if device.type != "cpu" else done.output
        received = torch.tensor(done.payload["received_splits"],
                                dtype=like.dtype if like is not None else torch.int32,
                                device=like.device if like is not None else "cpu")
        return output, received

    return _register(_submit(requests), finish)


@_keeps_runtime
class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name):
        output, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.name, ctx.received = name, received.tolist()
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        # The rows came back along the way they went: send each gradient row home.
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received,
                           name=_grad_name(ctx.name))
        return grad, None, None


@_routed
def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
             process_set=None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Send `splits[i]` rows of `tensor` (dim 0, in order) to rank i; differentiable.

    Without splits dim 0 is split evenly (it must divide by size()). Returns the rows
    received from every rank, concatenated in rank order; when `splits` is given, returns
    (output, received_splits) as Horovod does. Other dimensions must agree across ranks.
    """
    return _AlltoallFunction.apply(tensor, splits, name)


# ---------------------------------------------------------------------- reducescatter
def _reducescatter_request(tensor: torch.Tensor, name: Optional[str], full: str, op,
                           prescale_factor: float, postscale_factor: float) -> Request:
    runtime = _rt.get("reducescatter")
    what = _described("reducescatter", name)
    reduce_op = resolve_op(op)
    if reduce_op == ReduceOp.Adasum:
        # NotImplementedError is a RuntimeError, what Horovod raises here.
        raise NotImplementedError(f"{what}: op=Adasum is for allreduce only")
    core_op, pre, post = core_reduction(reduce_op, prescale_factor, postscale_factor, runtime.size)
    on_device = (isinstance(tensor, torch.Tensor) and tensor.is_cuda
                 and reduces_on_device(tensor, pre, post, runtime.config.nccl))
    if on_device:
        _check_gpu(tensor, name if name is not None else "(unnamed)", runtime)
    host = _host(tensor, name if name is not None else "(unnamed)", on_device=on_device)
    if tensor.dim() == 0:
        raise ValueError(f"{what}: a 0-d tensor has no first dimension to scatter")
    _check_complex_op(tensor, reduce_op, "reducescatter", name)
    spec = TensorSpec("reducescatter", dtype_name(tensor.dtype), tuple(tensor.shape),
                      op=reduce_op.name, prescale=float(prescale_factor),
                      postscale=float(postscale_factor), device=DEVICE if on_device else "")
    return Request(full, spec, host, None, core_op=core_op,
                   prescale=pre, postscale=post,
                   ready_event=ready_event(host) if on_device else None)


@_routed
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op=Average,
                        process_set=None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of `tensor`; synchronize(handle) returns this rank's block."""
    requests = _requests("reducescatter", [name], lambda _, full: _reducescatter_request(
        tensor, name, full, op, prescale_factor, postscale_factor))
    return _register(_submit(requests), _outputs_on([tensor.device], single=True))


@_routed
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op=Average, process_set=None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of several tensors as one operation; returns one handle."""
    tensors = list(tensors)
    names = _group_names(name, len(tensors))
    requests = _requests("reducescatter", names, lambda i, full: _reducescatter_request(
        tensors[i], names[i], full, op, prescale_factor, postscale_factor))
    return _register(_submit(requests), _outputs_on([t.device for t in tensors], single=False))


def _reducescatter_grads(grads: Sequence[torch.Tensor], op: ReduceOp,
                         scales: Tuple[float, float], name: Optional[str]) -> List[torch.Tensor]:
    """Input gradients of a reducescatter: every rank's output gradient, gathered back.

    Scaled as Horovod scales them: by the set's size for Sum, by 1 for Average, and by
    the prescale and postscale factors.
    """
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise RuntimeError(f"reducescatter is differentiable with op=Sum or Average, not "
                           f"{op.name}")
    factor = float(scales[0]) * float(scales[1])
    if op == ReduceOp.Sum:
        factor *= _rt.get("reducescatter").size
    gathered = grouped_allgather([g.contiguous() for g in grads], name=_grad_name(name))
    return [g * factor if factor != 1.0 else g for g in gathered]


@_keeps_runtime
class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.name, ctx.op, ctx.scales = name, op, (prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grads([grad_output], ctx.op, ctx.scales, ctx.name)[0], None, None, None, None


@_keeps_runtime
class _GroupedReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, *tensors):
        ctx.name, ctx.op, ctx.scales = name, op, (prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(
            tensors, name, op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None, None, *_reducescatter_grads(grad_outputs, ctx.op, ctx.scales, ctx.name))


def _wire_form(compression, tensor: torch.Tensor, kind: str):
    """Apply a Horovod-style compressor; those that reduce inside the runtime do not fit."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{kind}: the tensor must be a torch.Tensor, not {type(tensor).__name__}")
    if capabilities(compression).in_runtime:
        raise ValueError(f"{kind} takes Compression.none or Compression.fp16; "
                         f"{compression!r} reduces inside the allreduce only")
    payload, ctx = compression.compress(tensor)
    if not isinstance(payload, torch.Tensor):
        raise ValueError(f"{kind}: the compressor must encode a tensor as a single tensor")
    return payload, ctx


@_routed
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression=Compression.none, op=Average, process_set=None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's block of dim 0 (differentiable).

    Rank r gets dim0 // size() rows, plus one for the first dim0 % size() ranks.
    op: Average (default), Sum, Min, Max or Product (gradients for Sum and Average).
    """
    reduce_op = resolve_op(op)
    compression = _compressor(compression)
    payload, ctx = _wire_form(compression, tensor, "reducescatter")
    reduced = _ReducescatterFunction.apply(payload, name, reduce_op, prescale_factor,
                                           postscale_factor)
    return compression.decompress(reduced, ctx)


@_routed
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression=Compression.none, op=Average, process_set=None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter several tensors together; returns this rank's block of each."""
    tensors = list(tensors)
    if not tensors:
        return []
    reduce_op = resolve_op(op)
    compression = _compressor(compression)
    encoded = [_wire_form(compression, t, "grouped_reducescatter") for t in tensors]
    reduced = _GroupedReducescatterFunction.apply(name, reduce_op, prescale_factor,
                                                  postscale_factor, *[e[0] for e in encoded])
    return [compression.decompress(r, e[1]) for r, e in zip(reduced, encoded)]


# ---------------------------------------------------------------------- broadcast
def _broadcast_request(tensor: torch.Tensor, root_rank: int, name: Optional[str], full: str,
                       in_place: bool) -> Request:
    runtime = _rt.get("broadcast")
    root = int(root_rank)
    what = _described("broadcast", name)
    if runtime.global_ranks is not None:  # a process set: root_rank is a global rank
        if root not in runtime.global_ranks:
            raise ValueError(f"{what}: root_rank {root} is not in the process set with ranks "
                             f"{runtime.global_ranks}")
        root = runtime.global_ranks.index(root)
    elif not 0 <= root < runtime.size:
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {runtime.size} "
                         f"ranks")
    on_device = _moves_on_gpu(tensor, runtime, name or full)
    host = _host(tensor, name or full, reduced=False, on_device=on_device)
    output = host if in_place or not _shares_memory(host, tensor) else host.clone()
    spec = TensorSpec("broadcast", dtype_name(tensor.dtype), tuple(tensor.shape),
                      root=root, device=DEVICE if on_device else "")
    # The event comes after the clone, so the NCCL stream waits for the copy too.
    return Request(full, spec, host, output, root=root,
                   ready_event=ready_event(output) if on_device else None)


@_routed
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set=None) -> int:
    """Start broadcasting root's `tensor` into a new tensor on every rank."""
    requests = _requests("broadcast", [name], lambda _, full: _broadcast_request(
        tensor, root_rank, name, full, in_place=False))
    return _register(_submit(requests), _outputs_on([tensor.device], single=True))


@_routed
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set=None) -> int:
    """Start broadcasting root's `tensor` into `tensor` on every rank."""
    requests = _requests("broadcast", [name], lambda _, full: _broadcast_request(
        tensor, root_rank, name, full, in_place=True))
    return _register(_submit(requests), _finish_into([tensor], single=True))


@_keeps_runtime
class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.name, ctx.root_rank = name, root_rank
        return synchronize(broadcast_async(tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad_output):
        # As Horovod: the output gradient averaged over the ranks (of the set), kept on root.
        reduced = allreduce(grad_output.contiguous(), name=_grad_name(ctx.name), op=Average)
        if _global_rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


@_routed
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set=None) -> torch.Tensor:
    """Return root's `tensor` on every rank (differentiable)."""
    if not _needs_grad(tensor):
        return synchronize(broadcast_async(tensor, root_rank, name))
    return _BroadcastFunction.apply(tensor, root_rank, name)


@_routed
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set=None) -> torch.Tensor:
    """Overwrite `tensor` with root's on every rank; returns `tensor`."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast_parameters(params, root_rank: int, process_set=None) -> None:
    """Broadcast a state_dict or (name, tensor) pairs from root, in place (to the ranks of
    `process_set` only, when given)."""
    runtime_for(process_set, "broadcast_parameters()")  # a rank outside the set: named as such
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError("broadcast_parameters expects a dict (state_dict) or a sequence of "
                         "(name, tensor) pairs")
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: '{name}' is a {type(p).__name__}, "
                             f"not a tensor")
        handles.append(broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p,
                                        root_rank, name=None if name is None else
                                        f"parameter.{name}", process_set=process_set))
    for h in handles:
        synchronize(h)


def _sparse_embedding_params(model: Optional[torch.nn.Module]) -> Set[int]:
    """ids of the parameters of `model`'s sparse embeddings (those whose gradients are sparse)."""
    if model is None:
        return set()
    return {id(p) for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set=None) -> None:
    """Make every rank's (or every `process_set` member's) optimizer state and
    hyper-parameters equal to root's.

    `model` (as in Horovod) marks the parameters of sparse ``nn.Embedding`` modules: a fresh
    optimizer's zero gradients on them are sparse tensors (on every parameter for
    ``SparseAdam``), so that the gradients of the next backward accumulate as sparse ones.
    """
    runtime_for(process_set, "broadcast_optimizer_state()")  # before any gradient is set
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"broadcast_optimizer_state(): model must be a torch.nn.Module, not "
                        f"{type(model).__name__} (the third argument is Horovod's model; "
                        f"pass a process set as process_set=...)")
    if not optimizer.state:  # a fresh optimizer (no step taken yet)
        # As in Horovod, whose broadcast starts a fresh optimizer's state with a step on
        # zero gradients: afterwards every trainable parameter has a (zero) gradient.
        inner = getattr(optimizer, "_optimizer", optimizer)  # under a DistributedOptimizer
        sparse_everywhere = isinstance(inner, torch.optim.SparseAdam)
        sparse = _sparse_embedding_params(model) if isinstance(inner, torch.optim.SGD) else set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    grad = torch.zeros_like(p)
                    p.grad = grad.to_sparse() if sparse_everywhere or id(p) in sparse else grad
    state = _broadcast_state(optimizer, optimizer.state_dict(), root_rank, process_set)
    if rank() != root_rank:
        # load_state_dict replaces the group dicts; write the root's settings into the
        # existing ones instead, as Horovod does, so that whatever holds them (the
        # DistributedOptimizer around this optimizer, an LR scheduler) sees the new values.
        # (The same for the state mapping.)
        inner = getattr(optimizer, "_optimizer", None)  # under a DistributedOptimizer
        groups, states = optimizer.param_groups, optimizer.state
        # A DistributedOptimizer keeps this rank's own residuals (not the root's).
        getattr(optimizer, "_load_broadcast_state", optimizer.load_state_dict)(state)
        for mine, loaded in zip(groups, optimizer.param_groups):
            mine.update(loaded)
        states.clear()
        states.update(optimizer.state)
        for holder in (optimizer, inner):
            if holder is not None:
                holder.param_groups, holder.state = groups, states


# State tensors of at least this many bytes travel by broadcast rather than in the pickle:
# pickled, a 400 MB Adam state took 20 times as long and 1.4 GB more memory per rank.
_BROADCAST_STATE_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class _Broadcast:
    """Where a large tensor of the root's state was, in the pickled rest of it."""
    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype


def _mapped(obj: Any, leaf: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """`obj` rebuilt through its dicts, lists and tuples with `leaf(value, path)` applied to
    the rest (`path`: the keys and indices that lead to it)."""
    if isinstance(obj, dict):
        return {k: _mapped(v, leaf, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_mapped(v, leaf, path + (i,)) for i, v in enumerate(obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_mapped(v, leaf, path + (i,)) for i, v in enumerate(obj))
    return leaf(obj, path)


def _found(obj: Any, path: tuple) -> Any:
    """What `path` leads to in `obj`, or None."""
    for key in path:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _broadcast_state(optimizer: torch.optim.Optimizer, mine: Any, root_rank: int,
                     process_set) -> Any:
    """The root's optimizer `state_dict()` (`mine` there) on every rank: its large dense
    tensors by broadcast, the rest pickled. Elsewhere a tensor arrives in this rank's own tensor
    at the same place of `mine` (its own state_dict) when that one has the same shape and dtype
    on the host, else in a new host tensor (load_state_dict moves it to its parameter's
    device). Parameters that differ from the root's (in number or shape) fail every rank before
    any state is written."""
    large: List[torch.Tensor] = []

    def hollow(value: Any, path: tuple) -> Any:
        if (isinstance(value, torch.Tensor) and value.layout == torch.strided
                and value.numel() * value.element_size() >= _BROADCAST_STATE_BYTES):
            large.append(value.detach().cpu().contiguous())
            return _Broadcast(len(large) - 1, tuple(value.shape), value.dtype)
        return value

    shapes = [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups]
    sent = (_mapped(mine, hollow), shapes) if rank() == root_rank else None
    rest, root_shapes = broadcast_object(sent, root_rank, name="optimizer_state",
                                         process_set=process_set)
    problem = None if rank() == root_rank else _unlike(shapes, root_shapes, root_rank)
    problems = [p for p in allgather_object(problem, name="optimizer_state.check",
                                            process_set=process_set) if p is not None]
    if problems:
        raise ValueError("broadcast_optimizer_state: the parameters differ from the root's, "
                         "so its state cannot be loaded: " + "; ".join(problems))
    if rank() != root_rank:
        holes: List[Tuple[_Broadcast, tuple]] = []
        _mapped(rest, lambda v, path: holes.append((v, path)) if isinstance(v, _Broadcast)
                else None)
        used: Set[int] = set()
        # Only under "state": what else a state_dict holds (a DistributedOptimizer's own
        # residuals) this rank keeps, and must not be written over.
        large = [_receiver(hole, _found(mine, path) if path[:1] == ("state",) else None, used)
                 for hole, path in sorted(holes, key=lambda h: h[0].index)]
    handles = [broadcast_async_(t, root_rank, name=f"optimizer_state.{i}", process_set=process_set)
               for i, t in enumerate(large)]
    for handle in handles:
        synchronize(handle)
    return _mapped(rest, lambda v, _: large[v.index] if isinstance(v, _Broadcast) else v)


def _unlike(shapes: List[List[tuple]], root_shapes: List[List[tuple]],
            root_rank: int) -> Optional[str]:
    """How this rank's parameters differ from the root's (per group, in order), or None."""
    here = f"rank {_global_rank()}"
    if len(shapes) != len(root_shapes):
        return (f"{here} has {len(shapes)} parameter groups, root rank {root_rank} "
                f"{len(root_shapes)}")
    for g, (mine, root) in enumerate(zip(shapes, root_shapes)):
        if len(mine) != len(root):
            return (f"{here}: parameter group {g} has {len(mine)} parameters, "
                    f"{len(root)} on root rank {root_rank}")
        for i, (a, b) in enumerate(zip(mine, root)):
            if a != b:
                return (f"{here}: parameter {i} of group {g} has shape {list(a)}, "
                        f"{list(b)} on root rank {root_rank}")
    return None


def _receiver(hole: _Broadcast, own: Any, used: Set[int]) -> torch.Tensor:
    # This rank's own state tensor, when it fits: no new memory to allocate and fault in (a
    # 400 MB Adam state took twice as long into new tensors). Never one tensor twice: two
    # state entries may share it here, and each must get its own root value.
    if (isinstance(own, torch.Tensor) and own.device.type == "cpu" and own.is_contiguous()
            and own.layout == torch.strided and tuple(own.shape) == hole.shape
            and own.dtype == hole.dtype and not own.requires_grad
            and own.untyped_storage().data_ptr() not in used):
        used.add(own.untyped_storage().data_ptr())
        return own
    return torch.empty(hole.shape, dtype=hole.dtype)


def _to_bytes(obj: Any) -> torch.Tensor:
    # cloudpickle, as Horovod: lambdas, closures and classes defined in a script travel by
    # value; tensors inside pickle through torch's own reducers.
    data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return cloudpickle.loads(data.numpy().tobytes())


def _failure_note(what: str, obj: Any, exc: BaseException) -> torch.Tensor:
    """The message the other ranks raise when this rank cannot pickle `obj`, as bytes."""
    message = (f"{what}: rank {_global_rank()} could not pickle its object of type "
               f"'{type(obj).__name__}': {type(exc).__name__}: {exc}")[:4000]
    return torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)


def _pickled(what: str, obj: Any) -> Tuple[torch.Tensor, Optional[BaseException], int]:
    """(bytes to send, the pickling error or None, the size to announce). When `obj` cannot be
    pickled, the bytes are a message for the other ranks and the size is negative: they still
    run the same collectives (none is left waiting, names stay aligned) and raise it."""
    try:
        payload = _to_bytes(obj)
    except Exception as exc:  # noqa: BLE001 - whatever pickling an arbitrary object raises
        note = _failure_note(what, obj, exc)
        return note, exc, -note.numel()
    return payload, None, payload.numel()


@_routed
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=None) -> Any:
    """Pickle `obj` on root (with cloudpickle) and return it on every rank.

    Without a `name`, calls are numbered in order on each rank (not named after the type as
    in Horovod: a non-root rank may pass None, whose type differs from the root's object).
    If root cannot pickle `obj`, it raises that error and every other rank raises a
    ``RuntimeError`` naming root and the object's type.
    """
    if name is None:
        name = f"object{AUTO_NAME_MARK}{_auto_number(_object_broadcasts)}"
    base = name
    is_root = _global_rank() == root_rank
    failure: Optional[BaseException] = None
    payload, size_ = torch.empty(0, dtype=torch.uint8), 0
    if is_root:
        payload, failure, size_ = _pickled("broadcast_object", obj)
    length = broadcast_(torch.tensor([size_], dtype=torch.int64), root_rank, name=f"{base}.size")
    size_ = int(length.item())
    if not is_root:
        payload = torch.empty(abs(size_), dtype=torch.uint8)
    payload = broadcast_(payload, root_rank, name=f"{base}.data")
    if failure is not None:
        raise failure
    if size_ < 0:
        raise RuntimeError(payload.numpy().tobytes().decode(errors="replace"))
    return obj if is_root else _from_bytes(payload)


@_routed
def allgather_object(obj: Any, name: Optional[str] = None, process_set=None) -> List[Any]:
    """Pickle `obj` on every rank (with cloudpickle) and return the list of all ranks' objects.

    Without a `name`, the name is the object's type name, as in Horovod: the same on every
    rank whatever each has run before (a counter would differ on a rank that skipped an
    unnamed operation, for example while it had joined). A rank that cannot pickle its
    object raises that error, and the others a ``RuntimeError`` naming it.
    """
    base = name or f"object.{type(obj).__name__}"
    payload, failure, size_ = _pickled("allgather_object", obj)
    sizes = synchronize(allgather_async(torch.tensor([size_], dtype=torch.int64),
                                        name=f"{base}.sizes"))
    gathered = synchronize(allgather_async(payload, name=f"{base}.data"))
    parts, offset = [], 0
    for n in sizes.tolist():
        parts.append((n, gathered[offset:offset + abs(n)]))
        offset += abs(n)
    if failure is not None:
        raise failure
    failed = [part.numpy().tobytes().decode(errors="replace") for n, part in parts if n < 0]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [_from_bytes(part) for _, part in parts]


# ---------------------------------------------------------------------- barrier
@_routed
def barrier(process_set=None) -> None:
    """Block until every rank reaches the barrier."""
    runtime = _rt.get("barrier()")
    request = Request("barrier", TensorSpec("barrier", "none", ()),
                          torch.empty(0, dtype=torch.uint8), None)
    synchronize(_register([runtime.submit(request)], lambda requests: None))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; returns the rank that joined last.

    Blocks until every rank has joined. Until then this rank takes part in the others'
    allreduces with zeros (Average still divides by size()) and in their barriers, so
    ranks with uneven amounts of data do not hang. An allgather or a broadcast submitted
    while some rank has joined raises on the ranks that called it, as in Horovod; they can
    join afterwards. `device` is accepted for Horovod compatibility (tensors stay on the
    host).
    """
    runtime = _rt.get("join()")
    request = Request("join", TensorSpec("join", "none", ()),
                          torch.empty(0, dtype=torch.uint8), None)
    return int(runtime.wait(runtime.submit(request)).payload)


# ---------------------------------------------------------------------- timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a Chrome-trace timeline to `file_path` (rank 0 writes it).

    Same file format as ``FUSIONRING_TIMELINE``; `mark_cycles` adds a marker per cycle.
    Missing directories are created. Called again with the file being recorded, recording
    goes on in it; with another file, the first is closed. As in Horovod it is no collective
    (a script may call it on rank 0 alone): when rank 0 cannot open the file, rank 0 raises
    ``OSError`` naming it and the recording goes on as before.
    """
    runtime = _rt.global_runtime("start_timeline()")
    runtime.start_timeline(str(file_path), mark_cycles=mark_cycles)  # a str or a pathlib.Path


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    _rt.get("stop_timeline()").stop_timeline()
