"""``torch.amp.GradScaler`` used the plain torch way with a DistributedOptimizer.

``scaler.step(opt)`` unscales ``.grad`` and checks it for inf/NaN before it calls
``opt.step()``, and ``scaler.unscale_(opt)`` does the same for gradient clipping. With a
DistributedOptimizer the gradients' allreduces are still in flight at that point: the scaler
would read (and unscale in place) gradients a background thread is writing, and each rank
would decide on its own local gradients whether to skip the step. So GradScaler's two readers
of the gradients, ``unscale_`` and ``_check_inf_per_device`` (the fused optimizers' path), first
synchronize a DistributedOptimizer. The check then sees the reduced gradients, the same on
every rank, so every rank skips the same steps and keeps the same scale. Horovod's recipe
(``synchronize()``, ``unscale_``, ``step()`` inside ``skip_synchronize()``) is unchanged: the
gradients are synchronized once either way.
"""
from __future__ import annotations

import functools
import threading

_lock = threading.Lock()
_taught = False


def teach_grad_scaler(optimizer_class: type) -> None:
    """Make GradScaler synchronize instances of `optimizer_class` before reading gradients
    (once per process; torch.cuda.amp.GradScaler inherits it)."""
    global _taught
    with _lock:
        if _taught:
            return
        try:
            from torch.amp import GradScaler
        except ImportError:  # a torch without torch.amp.GradScaler has nothing to teach
            return
        for name in ("unscale_", "_check_inf_per_device"):
            original = getattr(GradScaler, name, None)
            if original is not None:
                setattr(GradScaler, name, _synchronizing_first(original, optimizer_class))
        _taught = True


def _synchronizing_first(original, optimizer_class: type):
    @functools.wraps(original)
    def method(self, optimizer, *args, **kwargs):
        if isinstance(optimizer, optimizer_class):
            optimizer._synchronize_for_scaler()
        return original(self, optimizer, *args, **kwargs)
    return method
