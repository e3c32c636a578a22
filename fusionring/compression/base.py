"""The Compressor role (Horovod's interface) and the Memory role (error feedback)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch


class Compressor:
    """Encodes a tensor before it travels and decodes it after.

    Horovod's interface: ``compress(tensor) -> (payload, ctx)`` and
    ``decompress(payload, ctx) -> tensor``.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class Memory:
    """Keeps what a compressor dropped (the residual) and adds it back next time."""

    def __init__(self) -> None:
        self.residuals: Dict[str, torch.Tensor] = {}

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(name)
        if residual is None or residual.shape != tensor.shape:
            return tensor
        return tensor + residual.to(tensor.dtype)

    def compensate_(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """In-place form of compensate: adds the stored residual into `tensor`; returns it."""
        residual = self.residuals.get(name)
        if residual is not None and residual.shape == tensor.shape:
            tensor.add_(residual.to(device=tensor.device, dtype=tensor.dtype))
        return tensor

    def update(self, name: str, residual: torch.Tensor) -> None:
        self.residuals[name] = residual.detach()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
