"""SyncBatchNorm: batch normalization with statistics over the global batch of all ranks."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from . import functions as F



class _GlobalBatchNorm(torch.autograd.Function):
    """Normalization with statistics of the global batch, and its gradient.

    Forward is torch's fused batch_norm kernel fed the global mean and variance. Backward
    needs two per-channel sums of the global batch: this rank's are reduced in one allreduce,
    then the input's gradient is formed in place (the same algorithm as torch's CUDA
    SyncBatchNorm)."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, count, name):
        out = torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.eps, ctx.count, ctx.name = eps, count, name
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, mean, var = ctx.saved_tensors
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + ctx.eps)
        xmu = x - mean.view(shape)
        sum_dy = grad_out.sum(dims)
        sum_dy_xmu = (grad_out * xmu).sum(dims)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd  # this rank's: the optimizer averages them
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        grad_x = None
        if ctx.needs_input_grad[0]:
            total = F.allreduce(torch.cat([sum_dy, sum_dy_xmu]), op=F.Sum,
                                name=f"{ctx.name}.grad")
            mean_dy = total[:channels] / ctx.count
            mean_dy_xmu = total[channels:] / ctx.count
            scale = invstd if weight is None else invstd * weight
            # dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)), times w * invstd
            grad_x = xmu.mul_((invstd * invstd * mean_dy_xmu).view(shape))
            grad_x = torch.sub(grad_out, grad_x).sub_(mean_dy.view(shape))
            grad_x.mul_(scale.view(shape))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _global_mean_var(x: torch.Tensor, dims, channels: int, name: str):
    """Per-channel mean and (biased) variance of every rank's batch, and its size.

    Each rank sends its count, mean and sum of squared deviations from its own mean; they are
    combined in double (Chan et al.'s pairwise formula), the same way on every rank. Sums of
    x and x*x would be one pass less, but var = E[x^2] - E[x]^2 cancels catastrophically in
    float32 when the mean is large against the spread: with inputs of mean 1000 and unit
    variance the outputs were off by 0.14, with mean 10^4 by 10^3."""
    count = x.numel() // max(channels, 1)
    shape = [1, channels] + [1] * (x.dim() - 2)
    if count:
        local_mean = x.mean(dims)
        deviation = x - local_mean.view(shape)
        local_m2 = deviation.mul_(deviation).sum(dims)
    else:  # an empty batch on this rank: it adds nothing
        local_mean = local_m2 = torch.zeros(channels, dtype=x.dtype)
    mine = torch.cat([local_mean.double(), local_m2.double(),
                      torch.tensor([float(count)], dtype=torch.float64)])
    every = F.allgather(mine.unsqueeze(0), name=name)  # (ranks, 2 C + 1), in rank order
    counts = every[:, -1:]
    n = counts.sum()
    means = every[:, :channels]
    mean = (counts * means).sum(0) / n
    m2 = every[:, channels:2 * channels].sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean.to(x.dtype), (m2 / n).to(x.dtype), n.to(x.dtype)


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (Horovod's ``hvd.SyncBatchNorm``).

    In training, mean and variance come from every rank's batch: one allgather of each rank's
    per-channel count, mean and squared deviations in the forward pass, and one allreduce of the two
    per-channel sums the input's gradient needs in the backward pass. In eval mode the running
    statistics are used, locally; without them (``track_running_stats=False``) the batch's
    statistics are global in eval mode too, as in Horovod.

    The collectives are named after the number of channels only, as Horovod names them
    without counting modules: a rank may build SyncBatchNorm modules the others do not (a
    model copy for evaluation) as long as every rank runs the same layers in the same order.
    Each layer's collective completes before the next layer's starts, so layers with the
    same number of channels never have the same name in flight.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if (not self.training and self.track_running_stats) or F.size() == 1:
            return super().forward(input)
        channels = input.shape[1]
        # Per channel count: one name per spec, so the negotiation's cache keeps hitting.
        name = f"sync_batch_norm.{channels}"
        dims = [0] + list(range(2, input.dim()))
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        with torch.no_grad():
            mean, var, n = _global_mean_var(x, dims, channels, name)
            if self.training and n <= 1:  # n is global: every rank raises alike
                raise ValueError(f"Expected more than 1 value per channel when training, got "
                                 f"{int(n)} over all ranks (input size {list(input.shape)} "
                                 f"on this rank)")
            if self.track_running_stats:
                self.num_batches_tracked += 1
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                            else self.momentum)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - momentum).add_(mean * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased * momentum)
        weight, bias = self.weight, self.bias
        if weight is not None and weight.dtype != x.dtype:  # a half-precision module
            weight, bias = weight.to(x.dtype), bias.to(x.dtype)
        out = _GlobalBatchNorm.apply(x, weight, bias, mean, var, self.eps, float(n), name)
        return out.to(input.dtype)
