"""SyncBatchNorm as in Horovod 0.28.1: collective names that do not depend on how many
SyncBatchNorm modules a rank built, and global statistics in eval mode without running
stats. Checked against torch's BatchNorm on the global batch in one process."""
import inspect

import torch

from conftest import run_ranks

PER_RANK = 3


def _model(norm):
    """Several normalization layers, two of them with the same number of channels."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), norm(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 1), norm(8), torch.nn.Conv2d(8, 4, 1),
                               norm(4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 3, 6, 6, generator=g) * (rank + 1) + rank


EXTRA_MODULE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r, P = hvd.rank(), hvd.size()
exec(HELPERS)
if r == 0:
    probe = hvd.SyncBatchNorm(8)  # e.g. a model copy rank 0 alone builds, for a summary
model = _model(hvd.SyncBatchNorm)
out = {"outputs": [], "input_grads": [], "param_grads": []}
for step in range(2):
    model.zero_grad()
    x = _batch(step, r).requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    out["outputs"].append(y.detach().tolist())
    out["input_grads"].append(x.grad.tolist())
    # each rank holds its share of the gradient of the global loss: their sum is the whole
    out["param_grads"].append([hvd.allreduce(p.grad, op=hvd.Sum, name="g%d.%d" % (step, i)).tolist()
                               for i, p in enumerate(model.parameters())])
out["buffers"] = {k: v.tolist() for k, v in model.state_dict().items() if "running" in k}
report(out)
'''


def test_sync_batch_norm_names_do_not_depend_on_modules_built(tmp_path):
    helpers = inspect.getsource(_model) + "\nPER_RANK = 3\n" + inspect.getsource(_batch)
    code = EXTRA_MODULE.replace("exec(HELPERS)", f"exec({helpers!r})")
    size = 2
    results = run_ranks(size, code, tmp_path, timeout=90,
                        env={"FUSIONRING_STALL_SHUTDOWN_S": "20"})
    reference = _model(torch.nn.BatchNorm2d)
    for step in range(2):
        reference.zero_grad()
        xs = [_batch(step, q).requires_grad_() for q in range(size)]
        y = reference(torch.cat(xs))
        weights = torch.cat([torch.linspace(-1, 1, y.numel() // size).view(PER_RANK, *y.shape[1:])
                             for _ in range(size)])
        (y * weights).sum().backward()
        for r, got in enumerate(results):
            part = y[r * PER_RANK:(r + 1) * PER_RANK].detach()
            assert torch.allclose(torch.tensor(got["outputs"][step]), part, atol=1e-4), (step, r)
            assert torch.allclose(torch.tensor(got["input_grads"][step]), xs[r].grad,
                                  atol=1e-4), (step, r)
            for value, p in zip(got["param_grads"][step], reference.parameters()):
                assert torch.allclose(torch.tensor(value), p.grad, atol=1e-3, rtol=1e-4), (step, r)
    for got in results:
        for key, value in reference.state_dict().items():
            if "running" in key:
                assert torch.allclose(torch.tensor(got["buffers"][key]), value, atol=1e-5), key


EVAL_NO_STATS = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
exec(HELPERS)
out = {}
bn = hvd.SyncBatchNorm(3, track_running_stats=False).eval()
x = _batch(0, r).requires_grad_()
y = bn(x)
(y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
out["no stats"] = [y.detach().tolist(), x.grad.tolist()]
# With running stats, eval mode normalizes with them, locally, as torch and Horovod do.
tracked = hvd.SyncBatchNorm(3).eval()
with torch.no_grad():
    tracked.running_mean.fill_(0.5)
    tracked.running_var.fill_(4.0)
out["running stats"] = tracked(_batch(0, r)).tolist()
report(out)
'''


def test_sync_batch_norm_in_eval_without_running_stats_uses_global_statistics(tmp_path):
    helpers = "\nPER_RANK = 3\n" + inspect.getsource(_batch)
    code = EVAL_NO_STATS.replace("exec(HELPERS)", f"exec({helpers!r})")
    size = 2
    results = run_ranks(size, code, tmp_path, timeout=60,
                        env={"FUSIONRING_STALL_SHUTDOWN_S": "20"})
    xs = [_batch(0, q).requires_grad_() for q in range(size)]
    y = torch.nn.BatchNorm2d(3, track_running_stats=False).eval()(torch.cat(xs))
    weights = torch.arange(y.numel() // size, dtype=y.dtype).view(PER_RANK, *y.shape[1:]).cos()
    (y * torch.cat([weights] * size)).sum().backward()
    for r, got in enumerate(results):
        outputs, grads = got["no stats"]
        assert torch.allclose(torch.tensor(outputs), y[r * PER_RANK:(r + 1) * PER_RANK].detach(),
                              atol=1e-5), r
        assert torch.allclose(torch.tensor(grads), xs[r].grad, atol=1e-5), r
        assert torch.allclose(torch.tensor(got["running stats"]), (_batch(0, r) - 0.5) / 2.0,
                              atol=1e-4), r


ONE_VALUE = r'''
import torch
import fusionring.torch as hvd
hvd.init()
r = hvd.rank()
bn = hvd.SyncBatchNorm(3)
out = {}
try:  # one value per channel over both ranks: rank 0 has one sample, rank 1 none
    bn(torch.ones(1 - r, 3))
except ValueError as exc:
    out["one"] = str(exc)
out["tracked"] = int(bn.num_batches_tracked)
out["two"] = bn(torch.arange(6.0).view(2, 3) + r).shape[0]  # still usable
report(out)
'''


def test_sync_batch_norm_refuses_one_value_per_channel_on_every_rank(tmp_path):
    """As torch's BatchNorm: training on one value per channel (counted over all ranks) is
    an error, raised on every rank, and nothing is tracked."""
    for out in run_ranks(2, ONE_VALUE, tmp_path, timeout=60):
        assert out["one"].startswith("Expected more than 1 value per channel when training, "
                                     "got 1 over all ranks"), out
        assert out["tracked"] == 0 and out["two"] == 2
