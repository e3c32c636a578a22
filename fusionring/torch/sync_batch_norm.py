"""SyncBatchNorm: batch normalization with statistics over the global batch of all ranks."""
from __future__ import annotations

import itertools

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from . import functions as F

_instances = itertools.count()


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (Horovod's ``hvd.SyncBatchNorm``).

    In training, mean and variance come from every rank's batch: one differentiable
    allreduce of the per-channel sums, sums of squares and counts, so autograd's backward
    reduces the statistics' gradients across ranks too. Modules must be created in the
    same order on every rank (their allreduce names derive from that order).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._sync_name = f"sync_batch_norm.{next(_instances)}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or F.size() == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.tensor([x.numel() // max(channels, 1)], dtype=x.dtype)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = F.allreduce(stats, op=F.Sum, name=self._sync_name)
        n = total[-1]
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                            else self.momentum)
                unbiased = var * (n / (n - 1)) if n > 1 else var
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach() * momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
