"""Adasum on tensors (fusionring/runtime/adasum_tree.py), which combines CUDA tensors over
NCCL, run here on CPU tensors over MPI: against the core's Adasum (csrc/adasum.cc) to a few
ulps (only the dot products' order of additions differs), and bitwise the same on every
rank."""
from __future__ import annotations

import pytest

from conftest import run_ranks

_CODE = """
import torch
from mpi4py import MPI
import fusionring.torch as hvd
from fusionring import state
from fusionring.dtypes import DTYPE_CODES
from fusionring.runtime.adasum_tree import adasum_allreduce

hvd.init()
comm = MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
core = state.get()._core


def sendrecv(send, recv, partner):
    comm.Sendrecv(send.numpy(), dest=partner, recvbuf=recv.numpy(), source=partner)


out = {}
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for count in (0, 1, 7, 1000, 4099):
        g = torch.Generator().manual_seed(count + 31 * rank)
        base = torch.randn(count, generator=g, dtype=torch.float64)
        if count > 10:  # correlated across ranks, as gradients are
            base = base + torch.linspace(-1, 1, count, dtype=torch.float64)
        x = base.to(dtype)
        mine, ref = x.clone(), x.clone()
        sent = adasum_allreduce(mine, rank, size, sendrecv, prescale=0.5, postscale=2.0)
        core.adasum(ref.data_ptr(), count, DTYPE_CODES[dtype], 0.5, 2.0)
        everyone = comm.allgather(mine.double().tolist())
        out[f"{dtype}:{count}"] = {
            "close": torch.allclose(mine.double(), ref.double(),
                                    rtol=1e-2 if dtype.itemsize == 2 else 1e-5, atol=1e-6),
            "ulps": (mine.double() - ref.double()).abs().max().item() if count else 0.0,
            "same_everywhere": all(e == everyone[0] for e in everyone),
            # about 2 (P-1)/P of the vector, give or take a value per halving
            "sent": abs(sent - count * x.element_size() * 2 * (size - 1) / size)
                    <= 2 * x.element_size() * (size.bit_length() - 1),
        }
report(out)
hvd.shutdown()
"""


@pytest.mark.parametrize("np", [1, 2, 4])
def test_adasum_on_tensors_agrees_with_the_core(tmp_path, np):
    results = run_ranks(np, _CODE, tmp_path, timeout=240)
    for rank, out in enumerate(results):
        for case, checks in out.items():
            assert checks["close"] and checks["same_everywhere"] and checks["sent"], (
                rank, case, checks)
