"""The compressor protocol, its capabilities, the method registry, and Memory (error feedback).

A compressor is Horovod's ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor``, plus capabilities that its class declares (class
attributes, read by :func:`capabilities`; nothing is guessed from which methods exist):

``summable``
    True: every part of the payload may be summed on the ring (the sum of encodings is the
    encoding of the sum). False: the payload must not be summed. None (not declared, as in
    Horovod's compressors): a single-tensor payload is summed, as Horovod does; a payload of
    several parts is refused.
``in_runtime``
    The compressor reduces on the runtime's background thread: ``communicate(context)``
    replaces the plain ring for its batches (see :class:`fusionring.reduction.ReductionContext`).
``reduces_into``
    ``compress_into(tensor, out) -> ctx`` and ``decompress_into(payload, ctx, out)`` write
    into tensors the caller keeps, so a training step allocates nothing.
``stateful``
    It keeps state across steps (residuals in a :class:`Memory`, say) that
    ``state_dict()`` / ``load_state_dict()`` save and restore with the optimizer.
``elementwise``
    compress() acts element by element, so a fusion group's buffer may be compressed as one
    tensor (the payload of a concatenation is the concatenation of the payloads).
``identity``
    compress() hands the tensor back unchanged (nothing to trace or decode).
``named``
    compress() takes the tensor's name as a keyword, ``compress(tensor, name=...)``, so a
    stateful compressor keeps its state (residuals, masks) per tensor rather than per shape.

Plain classes with static compress/decompress (Horovod's user compressors) declare nothing
and get the defaults. A class whose compress() is an instance method is instantiated with no
arguments where it is passed as ``compression=`` (:func:`resolve_compressor`). A method is registered under a name (``register_compressor``) and
reached as ``Compression.<name>``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any, ClassVar, Dict, Optional, Tuple, TypeVar

import torch

from ..reduction import ReductionContext


class Compressor:
    """Encodes a tensor before it travels and decodes it after (Horovod's interface).

    Subclasses declare their capabilities as class attributes; the defaults describe a
    Horovod-style compressor that the caller applies around a plain allreduce.
    """

    name: ClassVar[str] = ""
    summable: ClassVar[Optional[bool]] = None
    in_runtime: ClassVar[bool] = False
    reduces_into: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    identity: ClassVar[bool] = False
    named: ClassVar[bool] = False

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    # Only for `reduces_into`:
    def compress_into(self, tensor: torch.Tensor, out: torch.Tensor) -> Any:
        """compress() into `out`, a payload an earlier compress() of the same shape returned."""
        raise NotImplementedError

    def decompress_into(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """decompress() into `out`, the tensor that was compressed."""
        raise NotImplementedError

    # Only for `in_runtime`:
    def communicate(self, context: ReductionContext) -> Optional[int]:
        """Reduce the batch's outputs in place; return the bytes this rank sent (or None)."""
        raise NotImplementedError

    def reduces_on_gpu(self, tensor: torch.Tensor) -> bool:
        """Whether communicate() reduces this CUDA tensor on its GPU (with
        ``context.device_ring``); otherwise it is staged through host memory. The answer must
        depend on the configuration, dtype and shape only, so every rank gives the same."""
        return False

    # Only for `stateful`:
    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a compressor declared (see the module's docstring)."""

    name: str
    summable: Optional[bool]
    in_runtime: bool
    reduces_into: bool
    stateful: bool
    elementwise: bool
    identity: bool
    named: bool


_DEFAULT = Capabilities(name="", summable=None, in_runtime=False, reduces_into=False,
                        stateful=False, elementwise=False, identity=False, named=False)


@functools.lru_cache(maxsize=None)
def _declared(cls: type) -> Capabilities:
    if not issubclass(cls, Compressor):
        return dataclasses.replace(_DEFAULT, name=cls.__name__)
    name = cls.name if isinstance(cls.name, str) and cls.name else cls.__name__
    return Capabilities(name=name, summable=cls.summable,
                        in_runtime=bool(cls.in_runtime), reduces_into=bool(cls.reduces_into),
                        stateful=bool(cls.stateful), elementwise=bool(cls.elementwise),
                        identity=bool(cls.identity), named=bool(cls.named))


def capabilities(compressor: Any) -> Capabilities:
    """The capabilities `compressor` (a class or an instance) declares; a compressor that is
    no Compressor subclass (a Horovod-style plain class) has the defaults."""
    cls = compressor if isinstance(compressor, type) else type(compressor)
    declared = _declared(cls)
    if cls is not compressor and isinstance(getattr(compressor, "name", None), str):
        own = compressor.name  # an instance may name itself from its configuration
        if own and own != declared.name:
            return dataclasses.replace(declared, name=own)
    return declared


def resolve_compressor(compression: Any) -> Any:
    """`compression` as it is called: a class whose compress() is an instance method (a
    Compressor subclass written with ``def compress(self, tensor)``, reached as
    ``Compression.<name>``) becomes an instance built with no arguments; anything else (an
    instance, a class with static methods as Horovod's) is returned as it is."""
    if not isinstance(compression, type):
        return compression
    raw = inspect.getattr_static(compression, "compress", None)
    if raw is None or isinstance(raw, (staticmethod, classmethod)):
        return compression
    try:
        return compression()
    except TypeError as exc:
        raise ValueError(f"compression={compression.__name__}: its compress() needs an "
                         f"instance, and the class cannot be built without arguments ({exc}); "
                         f"pass an instance, {compression.__name__}(...)") from None


def compress_named(compression: Any, tensor: torch.Tensor, name: Optional[str]) -> Tuple[Any, Any]:
    """``compression.compress(tensor)``, given ``name=`` when the compressor declares `named`."""
    if name is not None and capabilities(compression).named:
        return compression.compress(tensor, name=name)
    return compression.compress(tensor)


def describe(compressor: Any) -> str:
    """A compressor's name for messages."""
    return capabilities(compressor).name or repr(compressor)


# ---------------------------------------------------------------------- registry
_REGISTRY: Dict[str, Any] = {}
_T = TypeVar("_T")


def register_compressor(name: str, method: Any = None) -> Any:
    """Make `method` (a Compressor class, or a factory returning one) ``Compression.<name>``.

    Used as ``register_compressor("fp16", FP16Compressor)`` or as a class decorator
    ``@register_compressor("fp16")``. A name may be registered once.
    """
    def add(obj: _T) -> _T:
        if not name.isidentifier():
            raise ValueError(f"compressor name {name!r} must be a Python identifier")
        if name in _REGISTRY and _REGISTRY[name] is not obj:
            raise ValueError(f"a compressor named {name!r} is already registered "
                             f"({_REGISTRY[name]!r})")
        _REGISTRY[name] = obj
        return obj

    return add if method is None else add(method)


def registered_compressors() -> Dict[str, Any]:
    """Every registered method by name (``Compression.<name>`` returns the same objects)."""
    return dict(_REGISTRY)


def lookup_compressor(name: str) -> Any:
    """The method registered under `name`; ValueError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; registered: "
                         f"{', '.join(sorted(_REGISTRY))}") from None


class _CompressionNames(type):
    """``Compression.<name>`` looks the name up in the registry."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return _REGISTRY[name]
        except KeyError:
            raise AttributeError(f"Compression has no method {name!r}; registered: "
                                 f"{', '.join(sorted(_REGISTRY))}") from None

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(_REGISTRY))


class Compression(metaclass=_CompressionNames):
    """Optional gradient compression used by allreduce and DistributedOptimizer: every
    registered method by name (``Compression.none``, ``Compression.fp16``,
    ``Compression.nm(2, 4)``)."""


def check_flag(method: str, argument: str, value: Any) -> bool:
    """`value` as a bool; ValueError naming the argument unless it is True/False (or 0/1):
    a string such as "no" would otherwise read as True."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if type(value).__name__ == "bool_":  # numpy's
        return bool(value)
    raise ValueError(f"{method}: {argument}={value!r} must be True or False")


def check_floating(method: str, tensor: torch.Tensor, name: Optional[str]) -> None:
    """ValueError naming the tensor unless it is real floating point: a lossy codec's
    compress() encodes float32 (float64, float16 and bfloat16 tensors are converted)."""
    if not tensor.is_floating_point():
        what = f"tensor '{name}'" if name is not None else "a tensor"
        raise ValueError(f"{method} compresses floating-point tensors; {what} is "
                         f"{str(tensor.dtype).replace('torch.', '')}")


def working_copy(tensor: torch.Tensor, device: torch.device, scratch: bool = False) -> torch.Tensor:
    """`tensor` as a flat float32 vector on `device` that an encoder may overwrite: with
    `scratch` (the caller's tensor is replaced by the decoded result anyway, as a DDP bucket
    is) the tensor itself where it already is one, else a copy."""
    if (scratch and tensor.dtype == torch.float32 and tensor.device == device
            and tensor.is_contiguous()):
        return tensor.detach().reshape(-1)
    return tensor.detach().to(device, torch.float32).reshape(-1).clone()


class Memory:
    """Keeps what a compressor dropped (the residual) and adds it back next time."""

    def __init__(self) -> None:
        self.residuals: Dict[str, torch.Tensor] = {}

    def fitting(self, name: Optional[str], numel: int) -> Optional[torch.Tensor]:
        """`name`'s residual when it holds `numel` values, else None. One of another size (from
        a checkpoint of another model, or a name reused for another tensor) cannot be added
        back: it is dropped with a warning, so the loss is never silent."""
        if name is None:
            return None
        stored = self.residuals.get(name)
        if stored is None or stored.numel() == numel:
            return stored
        del self.residuals[name]
        warnings.warn(f"fusionring: the residual kept for tensor '{name}' holds {stored.numel()} "
                      f"values but the tensor has {numel}; it is dropped (a checkpoint of another "
                      f"model, or the name reused for another tensor)", RuntimeWarning, stacklevel=3)
        return None

    def compensate(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        residual = self.fitting(name, tensor.numel())
        if residual is None:
            return tensor
        return tensor + residual.to(tensor.dtype).reshape(tensor.shape)

    def compensate_(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """In-place form of compensate: adds the stored residual into `tensor`; returns it."""
        residual = self.fitting(name, tensor.numel())
        if residual is not None:
            tensor.add_(residual.to(device=tensor.device, dtype=tensor.dtype).reshape(tensor.shape))
        return tensor

    def compensate_for_new(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """compensate_ `tensor` (flat float32), then return where the new residual goes: the
        residual just added, spent now, when it is a flat float32 one on the tensor's device
        (so a large tensor's residual is not a fresh allocation, with its page faults, every
        step), else a new tensor. The encoder writes it and ``update`` keeps it."""
        previous = self.fitting(name, tensor.numel())
        self.compensate_(name, tensor)
        if (previous is not None and previous.dtype == torch.float32
                and previous.device == tensor.device and previous.is_contiguous()):
            return previous.reshape(-1)
        return torch.empty(tensor.numel(), device=tensor.device)

    def update(self, name: str, residual: torch.Tensor) -> None:
        self.residuals[name] = residual.detach()

    def update_from(self, name: str, values: torch.Tensor) -> None:
        """Keep a copy of `values` (a view of a larger buffer) as `name`'s residual, written into
        the one kept before when it has the same size and device (no allocation each step)."""
        stored = self.residuals.get(name)
        if stored is not None and stored.numel() == values.numel() and stored.device == values.device:
            stored.reshape(-1).copy_(values.reshape(-1))
        else:
            self.residuals[name] = values.detach().clone()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}


__all__ = ["Capabilities", "Compression", "Compressor", "Memory", "capabilities", "check_flag",
           "check_floating", "compress_named", "describe", "lookup_compressor",
           "register_compressor", "registered_compressors", "resolve_compressor", "working_copy"]
