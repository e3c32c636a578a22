"""``horovod.common.util``'s names that scripts use: small helpers, and what this build has,
answered as Horovod's functions answer (Horovod asks each framework extension in a
subprocess; fusionring has one, for PyTorch, and knows its facts directly).

Imports no framework: torch is loaded only by ``gpu_available("torch")``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, List, Optional, Sequence

__all__ = ["ccl_built", "ddl_built", "env", "extension_available", "gloo_built",
           "gpu_available", "is_iterable", "mpi_built", "nccl_built", "num_rank_is_power_2",
           "split_list"]

# The framework extension this build has, by Horovod's extension name.
_EXTENSIONS = ("torch",)


@contextlib.contextmanager
def env(**kwargs: Optional[str]) -> Iterator[None]:
    """Set environment variables inside the block and restore them after; a None value
    leaves its variable alone."""
    given = {name: value for name, value in kwargs.items() if value is not None}
    before = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def split_list(items: Sequence[Any], n: int) -> List[Sequence[Any]]:
    """Split `items` into `n` consecutive chunks whose lengths differ by at most one (the
    longer ones first)."""
    chunk, extra = divmod(len(items), n)
    bounds = [i * chunk + min(i, extra) for i in range(n + 1)]
    return [items[bounds[i]:bounds[i + 1]] for i in range(n)]


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether `num_rank` is a power of two (what Adasum needs)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether this build has the framework extension `ext_base_name` ("torch" only)."""
    return ext_base_name in _EXTENSIONS


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the extension runs with a GPU here (for "torch": CUDA is available)."""
    if ext_base_name not in _EXTENSIONS:
        return False
    import torch

    return bool(torch.cuda.is_available())


def mpi_built(verbose: bool = False) -> bool:
    """fusionring always runs on MPI."""
    return True


def gloo_built(verbose: bool = False) -> bool:
    """fusionring has no Gloo controller."""
    return False


def nccl_built(verbose: bool = False) -> int:
    """NCCL's version code where NCCL loads (CUDA tensors are reduced over it), else 0."""
    from ..runtime.nccl import nccl_version

    return nccl_version()


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False
