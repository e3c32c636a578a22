"""The compressed ring on tensors (fusionring/runtime/compressed_ring.py), which carries
compressed batches on a GPU, run here on CPU tensors over MPI: it must give the core's
compressed ring's bits (result and residual) for the same codec and input."""
from __future__ import annotations

import pytest

from conftest import run_ranks

# Every rank's setup: the core's communicator and the ring's one transport step over MPI.
_RING = """
import torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import state
from fusionring.dtypes import VALUE_CODES
from fusionring.runtime.compressed_ring import compressed_allreduce

hvd.init()
comm = MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
core = state.get()._core


def exchange(send, recv):
    # right gets `send`, left's bytes land in `recv`
    comm.Sendrecv(send.numpy(), dest=(rank + 1) % size, recvbuf=recv.numpy(),
                  source=(rank - 1) % size)
"""

_CODE = _RING + """
from fusionring.compression.nm_codec import NmCodec

out = {}
for count in COUNTS:
    for n, m, values in ((2, 4, torch.float32), (1, 4, torch.float16), (3, 8, torch.bfloat16)):
        g = torch.Generator().manual_seed(1000 * count + 7 * rank + n + m)
        x = torch.randn(count, generator=g)
        old = torch.randn(count, generator=g) * 0.1
        mine, mine_res = x.clone(), old.clone()
        sent = compressed_allreduce(mine, NmCodec(n, m, values), exchange, rank, size,
                                    residual=mine_res, prescale=0.5, postscale=1.0 / size)
        ref, ref_res = x.clone(), old.clone()
        stats = core.nm_allreduce(ref.data_ptr(), count, n, m, VALUE_CODES[values],
                                  ref_res.data_ptr(), 0.5, 1.0 / size, 1 << 20)
        plain = x.clone()  # without error feedback
        compressed_allreduce(plain, NmCodec(n, m, values), exchange, rank, size)
        plain_ref = x.clone()
        core.nm_allreduce(plain_ref.data_ptr(), count, n, m, VALUE_CODES[values], 0, 1.0, 1.0,
                          1 << 20)
        out[f"{count}:{n}:{m}:{values}"] = [
            torch.equal(mine, ref), torch.equal(mine_res, ref_res),
            torch.equal(plain, plain_ref),
            # the same bytes on the wire, as long as the core sent each chunk as one payload
            sent["bytes_sent"] == stats["bytes_sent"] or count * 4 // size > (1 << 20)]
report(out)
hvd.shutdown()
"""


@pytest.mark.parametrize("np", [1, 2, 3])
def test_ring_on_tensors_gives_the_cores_bits(tmp_path, np):
    # 4: fewer granules than ranks (empty chunks); 4099: a partial last group;
    # 1 << 20 + 12: chunks of several of the core's 1 MiB segments.
    code = "COUNTS = [4, 4099, (1 << 20) + 12]\n" + _CODE
    results = run_ranks(np, code, tmp_path, timeout=240)
    for rank, out in enumerate(results):
        for case, checks in out.items():
            assert checks == [True, True, True, True], (rank, case, checks)


_CLUSTER = _RING + """
from fusionring.compression.cluster_codec import ClusterCodec

out = {}
segment_bytes = 64 << 10
for count in (3, 5000, 40_003):
    for k, sample, buckets, values in ((16, 1024, 16, torch.float32),
                                       (5, 300, 23, torch.float16),
                                       (64, 4096, 64, torch.bfloat16)):
        g = torch.Generator().manual_seed(count + 11 * rank + k)
        x = torch.randn(count, generator=g) * torch.exp(torch.randn(count, generator=g))
        old = torch.randn(count, generator=g) * 0.1
        for seed, step in ((0, 0), (9, 4)):
            codec = ClusterCodec(k, sample, buckets, values, seed, step, segment_bytes // 4,
                                 on_device=True)  # the torch kernels a GPU runs
            mine, mine_res = x.clone(), old.clone()
            sent = compressed_allreduce(mine, codec, exchange, rank, size, residual=mine_res,
                                        prescale=0.5, postscale=1.0 / size)
            ref, ref_res = x.clone(), old.clone()
            stats = core.cluster_allreduce(ref.data_ptr(), count, k, sample, buckets,
                                           VALUE_CODES[values], seed, step, ref_res.data_ptr(),
                                           0.5, 1.0 / size, segment_bytes)
            out[f"{count}:{k}:{values}:{seed}"] = [
                torch.equal(mine, ref), torch.equal(mine_res, ref_res),
                sent["bytes_sent"] == stats["bytes_sent"]]
report(out)
hvd.shutdown()
"""


@pytest.mark.parametrize("np", [1, 2, 3])
def test_cluster_ring_on_tensors_gives_the_cores_bits(tmp_path, np):
    """The cluster codec's torch kernels on the tensor ring against the core's ring: blocks
    of 64 KiB, so chunks of several blocks, and chunks of a value or none."""
    results = run_ranks(np, _CLUSTER, tmp_path, timeout=240)
    for rank, out in enumerate(results):
        for case, checks in out.items():
            assert checks == [True, True, True], (rank, case, checks)


_SHARED = """
import torch
import fusionring.torch as hvd
from fusionring import state
from fusionring.compression.nm import NMCompressor
from fusionring.dtypes import DTYPE_CODES
from fusionring.reduction import ReductionContext

hvd.init()
rt = state.get()
core = rt._core


def dense_sum(t):
    core.allreduce(t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype], 0, 1.0, 1.0, 1 << 20, 64 << 10)


def job(outputs):
    return ReductionContext(core=core, outputs=outputs, names=["a", "b", "c"],
                            keys=["a", "b", None], buffer=None, core_op=0, prescale=0.5,
                            postscale=1.0 / rt.size, ring_segment_bytes=1 << 20,
                            small_message_bytes=64 << 10, size=rt.size)


out = {}
for values in (torch.float32, torch.float16):
    one = NMCompressor(2, 4, values=values, schedule=[(0, (2, 4)), (3, (1, 8))])
    piped = NMCompressor(2, 4, values=values, schedule=[(0, (2, 4)), (3, (1, 8))])
    g = torch.Generator().manual_seed(11 + rt.rank)
    for step in range(5):  # dense first, then the shared mask, then a new level
        xs = [torch.randn(n, generator=g) for n in (70000, 4099, 33)]
        mine, ref = [x.clone() for x in xs], [x.clone() for x in xs]
        levels = [one._level(one._state(k)) for k in ["a", "b", None]]
        one._shared_reduce_one_pass(job(mine), mine, ["a", "b", None], levels, dense_sum)
        piped._shared_reduce(job(ref), ref, ["a", "b", None], levels, [])
        for c in (one, piped):
            for k in ("a", "b"):
                c._tensors[k].step += 1
        same = all(torch.equal(a, b) for a, b in zip(mine, ref))
        residuals = all(torch.equal(one.memory.residuals[k], piped.memory.residuals[k])
                        for k in ("a", "b"))
        estimates = all(torch.equal(one._tensors[k].estimate, piped._tensors[k].estimate)
                        and torch.equal(one._tensors[k].wait, piped._tensors[k].wait)
                        for k in ("a", "b"))
        out[f"{values}:{step}"] = [same, residuals, estimates]
    out[f"{values}:bytes"] = one.stats["wire_bytes"] == piped.stats["wire_bytes"]
report(out)
hvd.shutdown()
"""


@pytest.mark.parametrize("np", [1, 3])
def test_shared_mask_in_one_pass_gives_the_pipelines_bits(tmp_path, np):
    # The one-pass shared-mask reduction is what a GPU runs (NCCL sums the payload); here
    # the core sums it, so it must match the host's pipelined path bit for bit.
    results = run_ranks(np, _SHARED, tmp_path, timeout=240)
    for rank, out in enumerate(results):
        for case, checks in out.items():
            assert checks in (True, [True, True, True]), (rank, case, checks)
