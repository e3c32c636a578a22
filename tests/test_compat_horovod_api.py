"""Horovod behaviours ordinary scripts rely on, checked against independent references:
state_dicts with bool/int8 buffers broadcast, set_backward_passes_per_step, the broadcast
helpers on a process set, and errors before init()."""
import inspect

import torch

from conftest import run_ranks


def _buffered_model(seed: int) -> torch.nn.Module:
    """A GPT-style block: float parameters plus a bool causal mask and an int8 buffer."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("mask", torch.rand(4, 4) > 0.5)
    model.register_buffer("codes", torch.randint(-100, 100, (6,), dtype=torch.int8))
    model.register_buffer("small", torch.randint(-1000, 1000, (3,), dtype=torch.int16))
    return model


def test_broadcast_parameters_and_gathers_move_any_dtype(tmp_path):
    code = f'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
exec({inspect.getsource(_buffered_model)!r})
model = _buffered_model(10 + r)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
mask = hvd.allgather(torch.tensor([[r % 2 == 0, True]]))
codes = hvd.allgather(torch.tensor([r - 3], dtype=torch.int8))
flags = hvd.broadcast(torch.tensor([r == 1, False]), root_rank=1)
moved = hvd.alltoall(torch.arange(2 * hvd.size(), dtype=torch.int16) + 100 * r)
try:
    hvd.allreduce(torch.ones(2, dtype=torch.bool), name="bool_sum")
    refused = None
except ValueError as exc:
    refused = str(exc)
after = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
report({{"state": {{k: v.tolist() for k, v in model.state_dict().items()}},
         "mask": mask.tolist(), "codes": codes.tolist(), "flags": flags.tolist(),
         "moved": moved.tolist(), "refused": refused, "after": after}})
'''
    size = 2
    results = run_ranks(size, code, tmp_path)
    root = _buffered_model(10)
    for r, got in enumerate(results):
        for key, value in root.state_dict().items():
            assert got["state"][key] == value.tolist(), (r, key)
        assert got["mask"] == [[q % 2 == 0, True] for q in range(size)]
        assert got["codes"] == [q - 3 for q in range(size)]
        assert got["flags"] == [True, False]
        assert got["moved"] == [2 * r + i + 100 * q for q in range(size) for i in range(2)]
        assert got["refused"] is not None and "bool" in got["refused"]
        assert got["after"] == sum(range(size))


def _reference(world: int, steps: int, passes: int, batch: int):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(11)
    data = torch.randn(steps, passes, world * batch, 5, generator=g)
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):  # local sums over passes, averaged over ranks
            loss = sum(model(data[s, k, q * batch:(q + 1) * batch]).pow(2).mean()
                       for q in range(world)) / world
            loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_set_backward_passes_per_step_and_errors_before_init(tmp_path):
    steps, passes, batch = 3, 2, 4
    code = f'''
import inspect

import torch
import fusionring.torch as hvd
try:
    hvd.mpi_threads_supported()
    before_init = None
except ValueError as exc:
    before_init = str(exc)
hvd.init()
r, W = hvd.rank(), hvd.size()
torch.manual_seed(3)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
facts = [isinstance(opt, torch.optim.Optimizer), isinstance(opt, hvd.DistributedOptimizer)]
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
opt.set_backward_passes_per_step({passes})
g = torch.Generator().manual_seed(11)
data = torch.randn({steps}, {passes}, W * {batch}, 5, generator=g)
for s in range({steps}):
    opt.zero_grad()
    for k in range({passes}):
        model(data[s, k, r * {batch}:(r + 1) * {batch}]).pow(2).mean().backward()
    opt.step()
    sched.step()
report({{"before_init": before_init, "facts": facts,
         "params": [p.detach().tolist() for p in model.parameters()]}})
'''
    size = 2
    results = run_ranks(size, code, tmp_path)
    reference = _reference(size, steps, passes, batch)
    for got in results:
        assert got["before_init"] is not None and "init()" in got["before_init"]
        assert got["facts"] == [True, True]
        for value, expected in zip(got["params"], reference):
            assert torch.allclose(torch.tensor(value), expected, atol=1e-5, rtol=1e-4)


def _stepped(seed: int):
    """A model and an Adam optimizer with state (one step taken), from `seed`."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_broadcast_helpers_take_a_process_set(tmp_path):
    code = f'''
import torch
import fusionring.torch as hvd
members = hvd.ProcessSet([1, 3])
hvd.init(process_sets=[members])
r = hvd.rank()
exec({inspect.getsource(_stepped)!r})
model, opt = _stepped(r + 1)
if r in (1, 3):
    hvd.broadcast_parameters(model.state_dict(), root_rank=3, process_set=members)
    hvd.broadcast_optimizer_state(opt, root_rank=3, process_set=members)
state = opt.state_dict()
report({{"params": [p.detach().tolist() for p in model.parameters()],
         "lr": state["param_groups"][0]["lr"],
         "exp_avg": [state["state"][i]["exp_avg"].tolist() for i in range(2)]}})
'''
    results = run_ranks(4, code, tmp_path, timeout=120)
    for r, got in enumerate(results):
        source = 4 if r in (1, 3) else r + 1  # members end with rank 3's (seed 4), others keep theirs
        model, opt = _stepped(source)
        state = opt.state_dict()
        assert got["params"] == [p.detach().tolist() for p in model.parameters()], r
        assert got["lr"] == state["param_groups"][0]["lr"], r
        assert got["exp_avg"] == [state["state"][i]["exp_avg"].tolist() for i in range(2)], r


GROUPED_GRADIENTS = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, W = hvd.rank(), hvd.size()
out = {}
for op_name in ("Sum", "Average"):
    x = torch.arange(4.0, requires_grad=True)
    y = torch.full((2, 3), float(r + 1), requires_grad=True)
    outs = hvd.grouped_allreduce([x * 2, y], op=getattr(hvd, op_name), name=f"g.{op_name}")
    # Each rank weighs the outputs differently, so the gradient is a real reduction.
    (outs[0].sum() * (r + 1) + (outs[1] * (r + 2)).sum()).backward()
    out[op_name] = {"values": [o.detach().tolist() for o in outs],
                    "x_grad": x.grad.tolist(), "y_grad": y.grad.tolist()}

model = torch.nn.Linear(3, 2)
model.weight.requires_grad_(False)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters())
hvd.broadcast_optimizer_state(opt, root_rank=0)
out["grads_after_broadcast"] = [None if p.grad is None else p.grad.tolist()
                                for p in (model.weight, model.bias)]
report(out)
'''


def test_grouped_allreduce_is_differentiable_and_fresh_state_gets_zero_grads(tmp_path):
    """Like allreduce, grouped_allreduce backpropagates an allreduce of the output gradients
    with the same op; broadcast_optimizer_state on a fresh optimizer leaves every trainable
    parameter with a zero gradient, as Horovod's does."""
    size = 3
    results = run_ranks(size, GROUPED_GRADIENTS, tmp_path)
    weights_x = sum(r + 1 for r in range(size))  # d/d(outs[0]) summed over ranks
    weights_y = sum(r + 2 for r in range(size))
    for r, got in enumerate(results):
        for op_name, divide in (("Sum", 1), ("Average", size)):
            part = got[op_name]
            x_sum = torch.arange(4.0) * 2 * size
            y_sum = torch.full((2, 3), float(sum(q + 1 for q in range(size))))
            assert torch.allclose(torch.tensor(part["values"][0]), x_sum / divide)
            assert torch.allclose(torch.tensor(part["values"][1]), y_sum / divide)
            # The backward allreduce of d(loss)/d(out) uses the same op.
            assert torch.allclose(torch.tensor(part["x_grad"]),
                                  torch.full((4,), 2.0 * weights_x / divide)), (r, op_name)
            assert torch.allclose(torch.tensor(part["y_grad"]),
                                  torch.full((2, 3), float(weights_y) / divide)), (r, op_name)
        assert got["grads_after_broadcast"] == [None, [0.0, 0.0]]


FP16_OPTIMIZER = r'''
import copy, torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=hvd.Compression.fp16)
steps = []
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + r)
    x, y = torch.randn(8, 300, generator=g), torch.randn(8, 3, generator=g)
    plain = copy.deepcopy(model)  # this rank's own gradient, without the optimizer
    torch.nn.functional.mse_loss(plain(x), y).backward()
    local = [p.grad.clone() for p in plain.parameters()]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    reduced = [p.grad.clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    gathered = [hvd.allgather(t.unsqueeze(0), name=f"local.{step}.{i}")
                for i, t in enumerate(local)]
    steps.append({"reduced": [t.tolist() for t in reduced],
                  "dtypes": [str(t.dtype) for t in reduced],
                  "all_local": [t.tolist() for t in gathered]})
report(steps)
'''


def test_fp16_compressed_gradients_are_each_steps_average(tmp_path):
    """Compression.fp16 through DistributedOptimizer: every step's reduced gradient is the
    average of that step's float16-rounded local gradients (float32 again in .grad), also
    on the steps that reuse the previous step's wire buffers."""
    results = run_ranks(2, FP16_OPTIMIZER, tmp_path, timeout=90)
    for step in range(3):
        for rank in range(2):
            got = results[rank][step]
            assert got["dtypes"] == ["torch.float32"] * 4
            assert got["reduced"] == results[0][step]["reduced"]
            for reduced, all_local in zip(got["reduced"], got["all_local"]):
                halves = torch.tensor(all_local).half().float()
                expected = halves.mean(0)
                torch.testing.assert_close(torch.tensor(reduced), expected,
                                           rtol=2e-3, atol=2e-5)
                # Not the exact float32 average: the values did travel as float16.
                if step == 0 and expected.numel() > 100:
                    exact = torch.tensor(all_local).mean(0)
                    assert not torch.equal(torch.tensor(reduced), exact)


def test_horovod_submodule_imports_resolve_to_the_same_objects():
    """Scripts that import Horovod's submodules by name work with only `horovod` changed."""
    import fusionring.torch as hvd
    from fusionring.torch import mpi_ops
    from fusionring.torch.compression import Compression, Compressor, FP16Compressor, NoneCompressor
    from fusionring.torch.elastic import TorchState, run  # noqa: F401
    from fusionring.torch.functions import broadcast_optimizer_state, broadcast_parameters
    from fusionring.torch.optimizer import DistributedOptimizer
    from fusionring.torch.sync_batch_norm import SyncBatchNorm

    for name in ("allreduce", "allreduce_async_", "allgather", "broadcast_", "alltoall",
                 "reducescatter", "synchronize", "poll", "join", "barrier", "size", "rank",
                 "local_rank", "init", "shutdown", "Average", "Sum", "Adasum", "ProcessSet",
                 "global_process_set", "start_timeline", "mpi_threads_supported"):
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    assert "annotations" not in hvd.__all__ and "annotations" not in mpi_ops.__all__
    assert Compression is hvd.Compression and Compressor is hvd.Compressor
    assert Compression.fp16 is FP16Compressor and Compression.none is NoneCompressor
    assert (broadcast_parameters, broadcast_optimizer_state) == (hvd.broadcast_parameters,
                                                                 hvd.broadcast_optimizer_state)
    assert DistributedOptimizer is hvd.DistributedOptimizer
    assert SyncBatchNorm is hvd.SyncBatchNorm


def test_horovod_common_imports_resolve_to_the_same_objects():
    """`from horovod.common.exceptions import ...` and `horovod.common.process_sets` with only
    `horovod` changed, as elastic scripts write them."""
    import subprocess
    import sys

    import fusionring.torch as hvd
    from fusionring.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
    from fusionring.common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                                process_set_by_id, process_sets,
                                                remove_process_set)

    assert HorovodInternalError is hvd.HorovodInternalError
    assert HostsUpdatedInterrupt is hvd.elastic.HostsUpdatedInterrupt
    assert (ProcessSet, add_process_set, global_process_set, remove_process_set) == (
        hvd.ProcessSet, hvd.add_process_set, hvd.global_process_set, hvd.remove_process_set)
    # Like Horovod's, the exceptions can be imported without torch.
    done = subprocess.run([sys.executable, "-c", "import sys, fusionring.common.exceptions; "
                           "print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
