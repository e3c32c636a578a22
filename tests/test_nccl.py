"""The NCCL transport (fusionring/runtime/nccl.py): which allreduces go to the GPU, what
every rank is told when ranks disagree, and, on a machine with a GPU and CuPy, the results
against a reference computed on the host."""
from __future__ import annotations

import textwrap
import types

import pytest
import torch

import fusionring.torch as hvd
from fusionring.negotiation import TensorSpec, mismatch_message
from fusionring.runtime import nccl
from conftest import run_ranks

HAS_NCCL = torch.cuda.is_available() and nccl.nccl_module() is not None
needs_gpu = pytest.mark.skipif(not HAS_NCCL, reason="needs a CUDA GPU and CuPy's NCCL binding")


def _cuda_like(dtype: torch.dtype):
    """What reduces_on_device reads of a CUDA tensor, for machines without a GPU."""
    return types.SimpleNamespace(is_cuda=True, dtype=dtype,
                                 is_floating_point=lambda: dtype.is_floating_point)


@pytest.fixture
def nccl_loads(monkeypatch):
    monkeypatch.setattr(nccl, "nccl_module", lambda: types.SimpleNamespace(get_version=lambda: 22703))


def test_host_tensors_and_off_never_use_nccl(nccl_loads):
    assert not nccl.reduces_on_device(torch.ones(3), 1.0, 1.0, "on")
    assert not nccl.reduces_on_device(_cuda_like(torch.float32), 1.0, 1.0, "off")


def test_cuda_tensors_go_to_the_gpu_where_nccl_reduces_their_dtype(nccl_loads):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                  torch.int64, torch.uint8, torch.int8):
        assert nccl.reduces_on_device(_cuda_like(dtype), 1.0, 1.0, "auto"), dtype
    # NCCL has no 16-bit integers or booleans: those are staged through host memory.
    assert not nccl.reduces_on_device(_cuda_like(torch.int16), 1.0, 1.0, "auto")
    assert not nccl.reduces_on_device(_cuda_like(torch.bool), 1.0, 1.0, "auto")
    # Scaled integers keep the host path's rounding; scaled floats are scaled on the GPU.
    assert not nccl.reduces_on_device(_cuda_like(torch.int64), 1.0, 0.25, "auto")
    assert nccl.reduces_on_device(_cuda_like(torch.float32), 2.0, 0.25, "auto")


def test_without_nccl_auto_stages_through_host_and_on_refuses(monkeypatch):
    monkeypatch.setattr(nccl, "nccl_module", lambda: None)
    assert not nccl.reduces_on_device(_cuda_like(torch.float32), 1.0, 1.0, "auto")
    with pytest.raises(ValueError, match=r'FUSIONRING_NCCL=on.*pip install "fusionring\[gpu\]"'):
        nccl.reduces_on_device(_cuda_like(torch.float32), 1.0, 1.0, "on")


def test_nccl_built_reports_the_version_that_loads(nccl_loads):
    assert hvd.nccl_built() == 22703


@pytest.mark.skipif(nccl.nccl_module() is not None, reason="CuPy's NCCL binding loads here")
def test_nccl_built_is_zero_without_cupy():
    assert hvd.nccl_built() == 0


def test_ranks_that_disagree_on_the_gpu_path_are_told_which_rank_did_what():
    on_gpu = TensorSpec("allreduce", "float32", (4,), op="Average", device=nccl.DEVICE)
    on_host = TensorSpec("allreduce", "float32", (4,), op="Average")
    message = mismatch_message("allreduce.grad", [on_gpu, on_host, on_gpu])
    assert message is not None
    assert "reduced on" in message and "GPU (NCCL)" in message and "host memory" in message
    assert "rank 1" in message, message
    assert mismatch_message("allreduce.grad", [on_gpu, on_gpu]) is None


def test_host_tensors_still_reduce_with_nccl_required(tmp_path):
    # FUSIONRING_NCCL=on concerns CUDA tensors only; host tensors keep the MPI ring.
    results = run_ranks(2, """
        import torch, fusionring.torch as hvd
        hvd.init()
        x = torch.arange(6, dtype=torch.float32) * (hvd.rank() + 1)
        report(hvd.allreduce(x, op=hvd.Sum).tolist())
        hvd.shutdown()
    """, tmp_path, env={"FUSIONRING_NCCL": "on"})
    expected = (torch.arange(6, dtype=torch.float32) * 3).tolist()
    assert results == [expected, expected]


# ---------------------------------------------------------------------- on a GPU
_GPU_ONE_RANK = textwrap.dedent("""
    import torch, fusionring.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    NM_GPU = {shared: hvd.Compression.nm(n=2, m=4, shared_mask=shared) for shared in (0, 1)}
    NM_HOST = {shared: hvd.Compression.nm(n=2, m=4, shared_mask=shared) for shared in (0, 1)}
    out = {}
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64):
        x = (torch.randn(1000) * 100).to(dtype)
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            if op == hvd.Average and not dtype.is_floating_point:
                continue
            got = hvd.allreduce(x.cuda(), op=op, name=f"{dtype}.{int(op)}", prescale_factor=1.0)
            host = hvd.allreduce(x, op=op, name=f"host.{dtype}.{int(op)}")
            out[f"{dtype}.{int(op)}"] = [got.is_cuda, torch.equal(got.cpu(), host)]
    # Scale factors on the GPU, in the tensor's dtype.
    y = torch.randn(4096)
    got = hvd.allreduce(y.cuda(), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name="s")
    out["scaled"] = torch.allclose(got.cpu(), y * 0.5 * 3.0, rtol=1e-6)
    # A fused batch of tensors that do not lie back to back: packed on the GPU.
    ts = [torch.randn(n, device="cuda") for n in (3, 1000, 17, 65536)]
    refs = [t.cpu() for t in ts]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"g{i}") for i, t in enumerate(ts)]
    for h in handles:
        hvd.synchronize(h)
    out["grouped"] = all(torch.equal(t.cpu(), r) for t, r in zip(ts, refs))
    out["grouped_api"] = [t.is_cuda for t in hvd.grouped_allreduce(
        [torch.ones(5, device="cuda"), torch.ones(7, device="cuda")], op=hvd.Sum)]
    out["stats"] = hvd.communication_stats()["allreduce_tensors"] > 0
    # The other collectives move CUDA tensors on the GPU too.
    b = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    got = hvd.broadcast(b.cuda(), root_rank=0, name="b")
    out["broadcast"] = [got.is_cuda, torch.equal(got.cpu(), b)]
    got = hvd.allgather(b.cuda().bool(), name="ag")
    out["allgather"] = [got.is_cuda, torch.equal(got.cpu(), b.bool())]
    got, splits = hvd.alltoall(b.cuda(), splits=torch.tensor([3]), name="a2a")
    out["alltoall"] = [got.is_cuda, torch.equal(got.cpu(), b) and splits.tolist() == [3]]
    r = torch.randn(5, 3)
    got = hvd.reducescatter(r.cuda(), op=hvd.Sum, name="rs")
    out["reducescatter"] = [got.is_cuda, torch.equal(got.cpu(), hvd.reducescatter(
        r, op=hvd.Sum, name="rs.host"))]
    # N:M with per-rank masks (the compressed ring) and with a shared mask (one sum of the
    # kept values), with the CUDA kernels: the host's bits, step after step (the residuals
    # and the shared mask's estimates carry over).
    from fusionring import _C
    if getattr(_C, "nm_cuda_built", False):
        for shared in (0, 1):
            for step in range(3):
                z = torch.randn(10007)
                a = hvd.allreduce(z.cuda(), op=hvd.Sum, name=f"nm{shared}",
                                  compression=NM_GPU[shared])
                b = hvd.allreduce(z, op=hvd.Sum, name=f"nm{shared}.host",
                                  compression=NM_HOST[shared])
                out[f"nm{shared}.{step}"] = [a.is_cuda, torch.equal(a.cpu(), b)]
    report(out)
    hvd.shutdown()
""")


@needs_gpu
def test_one_rank_reduces_cuda_tensors_on_the_gpu(tmp_path):
    results = run_ranks(1, _GPU_ONE_RANK, tmp_path, timeout=180)[0]
    for key, value in results.items():
        if isinstance(value, list):
            assert value == [True, True], key
        elif isinstance(value, bool):
            assert value, key
    assert results["grouped_api"] == [True, True]


_GPU_TRAINING = textwrap.dedent("""
    import torch, fusionring.torch as hvd
    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    selection = SELECTION(model) if "SELECTION" in globals() else None
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=COMPRESSION, layer_selection=selection)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(2 + hvd.rank())
    for step in range(3):
        x = torch.randn(32, 64, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    report([p.detach().cpu().double().sum().item() for p in model.parameters()])
    hvd.shutdown()
""")


@needs_gpu
@pytest.mark.parametrize("compression", ["hvd.Compression.none", "hvd.Compression.fp16",
                                         "hvd.Compression.cluster(k=16, sample=512)"])
def test_a_training_step_on_the_gpu_matches_the_host(tmp_path, compression):
    runs = {}
    for device in ("cuda", "cpu"):
        code = f"DEVICE = {device!r}\nimport fusionring.torch as hvd\nCOMPRESSION = {compression}\n"
        runs[device] = run_ranks(1, code + _GPU_TRAINING, tmp_path / device, timeout=180)[0]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3, abs=1e-4)


@needs_gpu
@pytest.mark.parametrize("selection", ["hvd.LayerSelection.norm(0.5)",
                                       "hvd.LayerSelection.hyper(model, fraction=0.5)"])
def test_a_training_step_with_layer_selection_on_the_gpu_matches_the_host(tmp_path, selection):
    runs = {}
    for device in ("cuda", "cpu"):
        code = (f"DEVICE = {device!r}\nimport fusionring.torch as hvd\n"
                f"COMPRESSION = hvd.Compression.none\nSELECTION = lambda model: {selection}\n")
        runs[device] = run_ranks(1, code + _GPU_TRAINING, tmp_path / device, timeout=180)[0]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=1e-3, abs=1e-4)


_TWO_GPUS = textwrap.dedent("""
    import torch, fusionring.torch as hvd
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count() if SPREAD else 0)
    x = torch.full((1 << 20,), float(hvd.rank() + 1), device="cuda")
    try:
        dense = hvd.allreduce(x, op=hvd.Sum, name="x")[:4].tolist()
        same = []
        for shared in (False, True):  # two ranks: the GPU's sums are the host's, bit for bit
            on = [hvd.Compression.nm(n=2, m=4, shared_mask=shared) for _ in range(2)]
            g = torch.Generator().manual_seed(hvd.rank())
            for step in range(3):
                z = torch.randn(50001, generator=g)
                a = hvd.allreduce(z.cuda(), op=hvd.Average, name=f"nm{shared}", compression=on[0])
                b = hvd.allreduce(z, op=hvd.Average, name=f"nm{shared}.host", compression=on[1])
                same.append(torch.equal(a.cpu(), b))
        # The other collectives, with uneven parts, against the same calls on host tensors.
        r = hvd.rank()
        uneven = torch.arange(6 * (r + 1), dtype=torch.float64).reshape(-1, 2) + 100 * r
        even = torch.arange(10, dtype=torch.float32).reshape(5, 2) + 100 * r
        for kind, x, call in (
                ("allgather", uneven, lambda t, n: hvd.allgather(t, name=n)),
                ("alltoall", uneven,
                 lambda t, n: hvd.alltoall(t, splits=[1, t.shape[0] - 1], name=n)[0]),
                ("broadcast", even, lambda t, n: hvd.broadcast(t, root_rank=1, name=n)),
                ("reducescatter", even, lambda t, n: hvd.reducescatter(t, op=hvd.Sum, name=n))):
            a, b = call(x.cuda(), kind), call(x, kind + ".host")
            same.append(a.is_cuda and torch.equal(a.cpu(), b))
        # Adasum's tree on the GPUs: the host's to a few ulps. The cluster quantizer's ring on
        # the GPUs: a bucket mean may differ in its last bit, which can move a value near a
        # boundary to the next cluster, so the results are compared as a whole.
        z = torch.randn(40001, generator=g) + torch.linspace(-1, 1, 40001)
        a = hvd.allreduce(z.cuda(), op=hvd.Adasum, name="adasum")
        b = hvd.allreduce(z, op=hvd.Adasum, name="adasum.host")
        same.append(a.is_cuda and torch.allclose(a.cpu(), b, rtol=1e-5, atol=1e-6))
        on = [hvd.Compression.cluster(k=16, sample=1024) for _ in range(2)]
        for step in range(2):
            z = torch.randn(70001, generator=g)
            a = hvd.allreduce(z.cuda(), name="cq", compression=on[0])
            b = hvd.allreduce(z, name="cq.host", compression=on[1])
            same.append(a.is_cuda and float((a.cpu() - b).norm() / b.norm()) < 1e-2)
        # A joined rank takes part in GPU batches with zeros, as on the host.
        if r == 1:
            hvd.join()
        else:
            j = hvd.allreduce(torch.ones(8, device="cuda"), op=hvd.Sum, name="joined")
            same.append(j.tolist() == [1.0] * 8)
            hvd.join()
        report(["ok", dense, all(same)])
    except Exception as exc:
        report(["error", str(exc)])
    hvd.shutdown()
""")


@pytest.mark.skipif(not HAS_NCCL or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_on_two_gpus_sum_over_nccl(tmp_path):
    results = run_ranks(2, "SPREAD = True\n" + _TWO_GPUS, tmp_path, timeout=180)
    # N:M on the GPU (or staged through host without the CUDA kernels) gives the host's bits.
    assert results == [["ok", [3.0] * 4, True]] * 2


@needs_gpu
def test_two_ranks_on_one_gpu_are_refused_on_every_rank(tmp_path):
    results = run_ranks(2, "SPREAD = False\n" + _TWO_GPUS, tmp_path, timeout=180)
    for kind, text in results:
        assert kind == "error" and "same GPU" in text and "set_device" in text, text


def test_nm_reduces_on_the_gpu_only_where_its_bookkeeping_can(monkeypatch):
    from fusionring import _C
    from fusionring.compression.nm import NMCompressor

    monkeypatch.setattr(_C, "nm_cuda_built", True, raising=False)
    cuda = _cuda_like(torch.float32)
    for shared in (False, True):
        assert NMCompressor(2, 4, shared_mask=shared).reduces_on_gpu(cuda)
        assert NMCompressor(1, 8, shared_mask=shared,
                            schedule=[(0, (2, 8)), (10, (1, 8))]).reduces_on_gpu(cuda)
        # dense stages are one sum of the values, on the GPU too
        assert NMCompressor(2, 4, shared_mask=shared,
                            schedule=[(0, (6, 6)), (5, (2, 4))]).reduces_on_gpu(cuda)
        # the adaptive schedule's squared sums stay on the device; the kernels take m | 32
        assert NMCompressor(2, 4, shared_mask=shared, schedule="adaptive").reduces_on_gpu(cuda)
        assert not NMCompressor(2, 6, shared_mask=shared).reduces_on_gpu(cuda)
        assert not NMCompressor(2, 6, shared_mask=shared,
                                schedule="adaptive").reduces_on_gpu(cuda)
    monkeypatch.setattr(_C, "nm_cuda_built", False, raising=False)
    assert not NMCompressor(2, 4, shared_mask=False).reduces_on_gpu(cuda)


def test_cuda_built_says_whether_the_kernels_were_compiled(monkeypatch):
    from fusionring import _C

    for built in (True, False):
        monkeypatch.setattr(_C, "nm_cuda_built", built, raising=False)
        assert hvd.cuda_built() is built


_MIXED = textwrap.dedent("""
    import torch, fusionring.torch as hvd
    from fusionring.exceptions import TensorMismatchError
    hvd.init()
    x = torch.ones(4, device="cuda") if hvd.rank() == 0 else torch.ones(4)
    try:
        hvd.allreduce(x, name="mixed")
        report("no error")
    except TensorMismatchError as exc:
        report(str(exc))
    hvd.shutdown()
""")


@needs_gpu
def test_a_rank_on_the_gpu_and_one_on_the_host_are_told_on_both(tmp_path):
    results = run_ranks(2, _MIXED, tmp_path, timeout=180)
    for text in results:
        assert "reduced on" in text and "GPU (NCCL)" in text and "host memory" in text, text


class _Pending:
    """A CUDA event that never completes (a peer that stopped taking part)."""

    def query(self) -> bool:
        return False


class _Comm:
    def __init__(self, error=None):
        self.error, self.aborted = error, False

    def check_async_error(self):
        if self.error:
            raise RuntimeError(self.error)

    def abort(self):
        self.aborted = True


def _stalled_transport(monkeypatch, stall_s, error=None):
    monkeypatch.setattr(nccl, "nccl_module", lambda: types.SimpleNamespace(NcclError=RuntimeError))
    transport = nccl.NcclTransport(mpi_comm=None, rank=3, size=4, stall_shutdown_s=stall_s)
    transport._comm = comm = _Comm(error)
    return transport, comm


def test_a_stalled_gpu_batch_aborts_nccl_and_fails_this_and_later_batches(monkeypatch):
    transport, comm = _stalled_transport(monkeypatch, stall_s=0.05)
    with pytest.raises(hvd.HorovodInternalError, match=r"'grad' did not finish within 0.05 s on "
                                                      r"rank 3.*communicator was aborted"):
        transport._wait(_Pending(), lambda: "'grad'")
    assert comm.aborted
    with pytest.raises(hvd.HorovodInternalError, match="did not finish"):
        transport._connect(torch.device("cuda", 0))  # the next batch fails at once


def test_an_asynchronous_nccl_error_fails_the_batch_without_a_stall_limit(monkeypatch):
    transport, comm = _stalled_transport(monkeypatch, stall_s=None, error="remote process exited")
    with pytest.raises(hvd.HorovodInternalError, match=r"NCCL failed during 'grad' on rank 3: "
                                                      r"remote process exited"):
        transport._wait(_Pending(), lambda: "'grad'")
    assert comm.aborted


def test_a_tensor_on_another_gpu_is_refused_on_its_own_rank():
    from fusionring.torch import functions

    runtime = types.SimpleNamespace(gpu=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"tensor 'w' is on cuda:1, but this rank's collectives "
                                         r"run on cuda:0: NCCL takes one GPU per rank"):
        functions._check_gpu(types.SimpleNamespace(device=torch.device("cuda", 1)), "w", runtime)
    functions._check_gpu(types.SimpleNamespace(device=torch.device("cuda", 0)), "w", runtime)
    functions._check_gpu(types.SimpleNamespace(device=torch.device("cuda", 1)), "w",
                         types.SimpleNamespace(gpu=None))  # before the first GPU collective


_DDP_HOOKS_ON_NCCL = textwrap.dedent("""
    import os, socket, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from fusionring.ddp import hooks
    from fusionring.selection import LayerSelection
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    out = {}
    for name in ("nm", "cluster", "layers"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4)).cuda()
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.001)
        state, hook = {
            "nm": (hooks.NMState(None, n=2, m=4), hooks.nm_hook),
            "cluster": (hooks.ClusterState(None, k=8, sample=256), hooks.cluster_hook),
            "layers": (hooks.LayerSelectionState(None, selection=LayerSelection.norm(0.5),
                                                 model=model), hooks.layer_selection_hook),
        }[name]
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(8, 32, device="cuda")).square().mean().backward()
            opt.step()
        out[name] = all(p.is_cuda and bool(torch.isfinite(p).all()) for p in model.parameters())
    dist.destroy_process_group()
    report(out)
""")


@needs_gpu
def test_ddp_hooks_run_on_an_nccl_group(tmp_path):
    """Every fusionring hook on GPU buckets of an NCCL process group (one rank)."""
    assert run_ranks(1, _DDP_HOOKS_ON_NCCL, tmp_path, timeout=180)[0] == {
        "nm": True, "cluster": True, "layers": True}


_PS_GPU_WORKER = textwrap.dedent("""
    import atexit, torch
    from mpi4py import MPI
    from fusionring import ps
    if MPI.COMM_WORLD.Get_rank() == 0:  # the server exits inside ps.init()
        atexit.register(report, {"server": True})
    ps.init(num_servers=1)
    if True:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 2)).to(DEVICE)
        opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(), sync="bsp",
                                      compression=COMPRESSION)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(8, 16, generator=g).to(DEVICE)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        report([p.detach().cpu().double().sum().item() for p in model.parameters()]
               + [all(p.device.type == DEVICE for p in model.parameters())])
    ps.shutdown()
""")


@needs_gpu
@pytest.mark.parametrize("compression", ["hvd.Compression.none", "hvd.Compression.fp16",
                                         "hvd.Compression.cluster(k=8, sample=256)"])
def test_a_parameter_server_worker_trains_a_gpu_model(tmp_path, compression):
    """A worker's CUDA model: gradients encoded on the host, parameters received there and
    copied to the GPU; the same training as a CPU worker's."""
    runs = {}
    for device in ("cuda", "cpu"):
        code = (f"DEVICE = {device!r}\nimport fusionring.torch as hvd\n"
                f"COMPRESSION = {compression}\n")
        runs[device] = run_ranks(2, code + _PS_GPU_WORKER, tmp_path / device, timeout=180)[1]
    assert runs["cuda"][-1] is True and runs["cpu"][-1] is True
    assert runs["cuda"][:-1] == pytest.approx(runs["cpu"][:-1], rel=1e-4, abs=1e-5)
