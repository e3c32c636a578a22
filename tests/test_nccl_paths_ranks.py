"""The GPU path's control flow and arithmetic, on a machine without a GPU.

The ranks' tensors claim to be CUDA tensors (a torch.Tensor subclass whose ``is_cuda`` is
True, still in host memory) and the NCCL communicator is a stand-in over MPI: allReduce is
the core's ring, send/recv in a group are MPI's nonblocking pair, bcast and reduceScatter are
MPI's and the core's. Everything else is fusionring's own GPU path: the per-tensor decision
and the spec that carries it, the fusion of GPU batches, NcclAllreduce's pack, scaling and
unpack, the byte arithmetic of broadcast, allgather, alltoall and reducescatter on the GPU,
N:M's GPU reductions (the CUDA kernels' entry points call the CPU kernels), the cluster
quantizer's (its torch kernels) and Adasum's tree. Each result
must equal the same call on host tensors (MPI's path), and the stand-in must have been used.
"""
from __future__ import annotations

import pytest

from conftest import run_ranks

_CODE = """
import contextlib, ctypes, types
import numpy as np
import torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import _C
from fusionring.dtypes import DTYPE_CODES
from fusionring.runtime import nccl as nccl_module_file
from fusionring.runtime.nccl import NcclTransport


class FakeCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


class _Event:
    def __init__(self, *args, **kwargs): pass
    def record(self, *args): pass
    def query(self): return True
    def synchronize(self): pass
    def elapsed_time(self, other): return 0.0


torch.cuda.Event = _Event
torch.cuda.current_stream = lambda *args: types.SimpleNamespace(cuda_stream=0)
CALLS = {"allReduce": 0, "send": 0, "recv": 0, "bcast": 0, "reduceScatter": 0,
         "cluster_kernels": 0}
PENDING = []


def _view(address, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


class FakeComm:
    def __init__(self, comm):
        self.comm = comm.Dup()
        self.core = _C.Communicator(MPI._handleof(self.comm))

    def allReduce(self, send, recv, count, dtype, op, stream):
        assert send == recv
        CALLS["allReduce"] += 1
        self.core.allreduce(recv, count, dtype, op, 1.0, 1.0, 1 << 20, 64 << 10)

    def bcast(self, address, count, dtype, root, stream):
        CALLS["bcast"] += 1
        self.comm.Bcast(_view(address, count), root=root)

    def send(self, address, count, dtype, peer, stream):
        CALLS["send"] += 1
        PENDING.append(self.comm.Isend(_view(address, count), dest=peer))

    def recv(self, address, count, dtype, peer, stream):
        CALLS["recv"] += 1
        PENDING.append(self.comm.Irecv(_view(address, count), source=peer))

    def reduceScatter(self, send, recv, count, dtype, op, stream):
        CALLS["reduceScatter"] += 1
        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        block = count * _C.element_size(dtype)
        whole = _view(send, block * size).copy()
        self.core.allreduce(whole.ctypes.data, count * size, dtype, op, 1.0, 1.0, 1 << 20, 64 << 10)
        _view(recv, block)[:] = whole[rank * block:(rank + 1) * block]


def _group_end():
    MPI.Request.Waitall(PENDING)
    PENDING.clear()


FAKE = types.SimpleNamespace(
    NcclError=RuntimeError, get_version=lambda: 99999, groupStart=lambda: None,
    groupEnd=_group_end, NCCL_SUM=0, NCCL_MIN=1, NCCL_MAX=2, NCCL_PROD=3,
    **{f"NCCL_{name}": DTYPE_CODES[getattr(torch, dtype)] for name, dtype in (
        ("FLOAT32", "float32"), ("FLOAT64", "float64"), ("FLOAT16", "float16"),
        ("BFLOAT16", "bfloat16"), ("INT8", "int8"), ("UINT8", "uint8"), ("INT32", "int32"),
        ("INT64", "int64"))})
nccl_module_file.nccl_module = lambda: FAKE


def _connect(self, device):
    if self._comm is None:
        self._comm = FakeComm(self._mpi)
        self.device = device
        self.stream = types.SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)


NcclTransport._connect = _connect
# NcclTransport.on_stream runs as written: the stream's context is a no-op and every event
# has completed.
torch.cuda.device = lambda device: contextlib.nullcontext()
torch.cuda.stream = lambda stream: contextlib.nullcontext()
# The N:M kernels "on the GPU" are the CPU kernels with the GPU kernels' arguments.
_C.nm_cuda_built = True
_C.nm_compress_cuda = lambda src, count, n, m, values, code, mask, residual, stream: (
    _C.nm_compress(src, DTYPE_CODES[torch.float32], count, n, m, values, code, mask, residual))
_C.nm_gather_cuda = lambda src, count, n, m, mask, out, code, residual, stream: (
    _C.nm_gather(src, DTYPE_CODES[torch.float32], count, mask, out, code, residual))
_C.nm_scatter_cuda = lambda values, code, mask, count, n, m, out, accumulate, stream: (
    _C.nm_scatter_add(values, code, mask, count, out) if accumulate
    else _C.nm_scatter(values, code, mask, count, out, DTYPE_CODES[torch.float32]))

hvd.init()
rank, size = hvd.rank(), hvd.size()
assert hvd.nccl_built() == 99999


def gpu(t):
    return t.clone().as_subclass(FakeCuda)


def same(a, b):
    return a.dtype == b.dtype and torch.equal(torch.Tensor.as_subclass(a, torch.Tensor), b)


out = {}
g = torch.Generator().manual_seed(3 + rank)
ints = lambda *shape: torch.randint(-50, 50, shape, generator=g).float()
for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
    x = ints(1000)
    out[f"allreduce.{int(op)}"] = same(hvd.allreduce(gpu(x), op=op, name=f"a{int(op)}"),
                                       hvd.allreduce(x, op=op, name=f"h{int(op)}"))
for dtype in (torch.float16, torch.bfloat16, torch.int64, torch.float64):
    x = ints(77).to(dtype)
    out[f"allreduce.{dtype}"] = same(hvd.allreduce(gpu(x), op=hvd.Sum, name=f"d{dtype}"),
                                     hvd.allreduce(x, op=hvd.Sum, name=f"hd{dtype}"))
x = ints(300)
out["scaled"] = same(hvd.allreduce(gpu(x), op=hvd.Sum, prescale_factor=0.5,
                                   postscale_factor=4.0, name="sc"),
                     hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0,
                                   name="hsc"))
# A fused batch of several tensors (packed and unpacked by NcclAllreduce), in place.
xs = [ints(n) for n in (5, 4096, 1, 300000)]
mine = [gpu(x) for x in xs]
handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"f{i}") for i, t in enumerate(mine)]
for h in handles:
    hvd.synchronize(h)
refs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="hf")
out["fused"] = all(same(a, b) for a, b in zip(mine, refs))
out["grouped"] = all(same(a, b) for a, b in zip(
    hvd.grouped_allreduce([gpu(x) for x in xs], op=hvd.Average, name="gg"),
    hvd.grouped_allreduce(xs, op=hvd.Average, name="hg")))
z = torch.complex(ints(10), ints(10))
out["complex"] = same(hvd.allreduce(gpu(z), op=hvd.Sum, name="cz"),
                      hvd.allreduce(z, op=hvd.Sum, name="hcz"))
# The other collectives, with uneven parts.
uneven = torch.arange(6 * (rank + 1), dtype=torch.int16).reshape(-1, 2) + 100 * rank
even = ints(5, 3)
out["allgather"] = same(hvd.allgather(gpu(uneven), name="ag"), hvd.allgather(uneven, name="hag"))
out["allgather.bool"] = same(hvd.allgather(gpu(uneven > 3), name="agb"),
                             hvd.allgather(uneven > 3, name="hagb"))
splits = [(rank + p) % 3 for p in range(size)]
rows = sum(splits)
a2a = torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) + 1000 * rank
got, got_splits = hvd.alltoall(gpu(a2a), splits=splits, name="a2a")
ref, ref_splits = hvd.alltoall(a2a, splits=splits, name="ha2a")
out["alltoall"] = same(got, ref) and got_splits.tolist() == ref_splits.tolist()
out["broadcast"] = same(hvd.broadcast(gpu(even), root_rank=size - 1, name="bc"),
                        hvd.broadcast(even, root_rank=size - 1, name="hbc"))
inplace = gpu(even)
hvd.broadcast_(inplace, root_rank=0, name="bci")
out["broadcast_"] = same(inplace, hvd.broadcast(even, root_rank=0, name="hbci"))
for op in (hvd.Sum, hvd.Average, hvd.Max):
    r = ints(2 * size + 1, 3)
    out[f"reducescatter.{int(op)}"] = same(
        hvd.reducescatter(gpu(r), op=op, name=f"rs{int(op)}"),
        hvd.reducescatter(r, op=op, name=f"hrs{int(op)}"))
# N:M on the GPU path: a shared mask (one sum of the kept values) and per-rank masks (the
# compressed ring over send/recv), step after step, against the host's N:M.
before = dict(CALLS)
for shared in (True, False):
    on_gpu, on_host = (hvd.Compression.nm(n=2, m=4, shared_mask=shared) for _ in range(2))
    for step in range(3):
        x = torch.randn(5003, generator=g)
        out[f"nm.{shared}.{step}"] = same(
            hvd.allreduce(gpu(x), name=f"nm{shared}", compression=on_gpu),
            hvd.allreduce(x, name=f"hnm{shared}", compression=on_host))
out["nm.on_gpu"] = CALLS["allReduce"] > before["allReduce"] and CALLS["send"] > before["send"]
# The adaptive schedule: its squared sums taken where the tensors lie, one copy per batch.
from fusionring.compression.nm_schedules import AdaptiveSchedule
for shared in (True, False):
    on_gpu, on_host = (hvd.Compression.nm(n=1, m=4, shared_mask=shared,
                                          schedule=AdaptiveSchedule.halving(1, 4, patience=2))
                       for _ in range(2))
    levels = []
    for step in range(8):
        x = torch.randn(5003, generator=g) * (1 + step)
        out[f"nm.adaptive.{shared}.{step}"] = same(
            hvd.allreduce(gpu(x), name=f"na{shared}", compression=on_gpu),
            hvd.allreduce(x, name=f"hna{shared}", compression=on_host))
        levels.append(on_gpu.level(f"allreduce.na{shared}"))
        out[f"nm.adaptive.{shared}.{step}.level"] = (
            levels[-1] == on_host.level(f"allreduce.hna{shared}"))
    out[f"nm.adaptive.{shared}.moved"] = len(set(levels)) > 1
# The cluster quantizer on the GPU path: the compressed ring over send/recv with the torch
# kernels, residuals kept between steps, against the host's (the core's ring and kernels).
from fusionring.compression import cluster_kernels
_encode = cluster_kernels.encode_blocks


def _counted_encode(*args):
    CALLS["cluster_kernels"] += 1
    return _encode(*args)


cluster_kernels.encode_blocks = _counted_encode
on_gpu, on_host = (hvd.Compression.cluster(k=8, sample=512) for _ in range(2))
for step in range(3):
    xs = [torch.randn(n, generator=g) for n in (3000, 17)]
    got = hvd.grouped_allreduce([gpu(x) for x in xs], name="cq", compression=on_gpu)
    ref = hvd.grouped_allreduce(xs, name="hcq", compression=on_host)
    out[f"cluster.{step}"] = all(same(a, b) for a, b in zip(got, ref))
out["cluster.residuals"] = all(
    torch.equal(a, b) for a, b in zip(on_gpu.memory.residuals.values(),
                                      on_host.memory.residuals.values()))
# Adasum on the GPU path: the tree over send/recv (a power of two ranks only), against the
# core's on host tensors to a few ulps (the dot products add in another order).
if size & (size - 1) == 0:
    before = dict(CALLS)
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(1001, generator=g) + torch.linspace(-1, 1, 1001)).to(dtype)
        got = hvd.allreduce(gpu(x), op=hvd.Adasum, name=f"ad{dtype}")
        ref = hvd.allreduce(x, op=hvd.Adasum, name=f"had{dtype}")
        out[f"adasum.{dtype}"] = got.dtype == dtype and torch.allclose(
            torch.Tensor.as_subclass(got, torch.Tensor).double(), ref.double(),
            rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-6)
    out["adasum.on_gpu"] = CALLS["send"] > before["send"]
# A process set has a communicator (and transport) of its own.
members = [0, 1] if hvd.size() > 2 else [0]  # a set of every rank would be the global set
pair = hvd.add_process_set(members)
if rank in members:
    x = ints(64)
    out["process_set"] = same(hvd.allreduce(gpu(x), op=hvd.Sum, name="ps", process_set=pair),
                              hvd.allreduce(x, op=hvd.Sum, name="hps", process_set=pair))
hvd.remove_process_set(pair)
out["calls"] = {k: v > 0 for k, v in CALLS.items()}
report(out)
hvd.shutdown()
"""


@pytest.mark.parametrize("np", [2, 3])
def test_gpu_path_over_a_stand_in_for_nccl_gives_the_host_results(tmp_path, np):
    results = run_ranks(np, _CODE, tmp_path, timeout=240)
    for rank, out in enumerate(results):
        calls = out.pop("calls")
        assert all(calls.values()), (rank, calls)
        bad = {k: v for k, v in out.items() if v is not True}
        assert not bad, (rank, bad)
