"""What a source distribution carries, and how the build backend judges the tools it finds."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import build_backend  # noqa: E402


def test_the_sdist_carries_what_building_the_core_needs(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    (archive,) = tmp_path.glob("fusionring-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("CMakeLists.txt", "tools/build_backend.py", "pyproject.toml", "setup.py",
                   "fusionring/__init__.py"):
        assert needed in names, needed
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").iterdir() if p.is_file()}
    assert sources and sources <= names, sorted(sources - names)


def test_a_tool_that_exists_but_fails_to_run_counts_as_missing(tmp_path, monkeypatch):
    for name, status in (("frtool-broken", 1), ("frtool-fine", 0)):
        script = tmp_path / name
        script.write_text(f"#!/bin/sh\nexit {status}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ["PATH"])
    assert not build_backend._has_tool("frtool-broken")  # e.g. pip's cmake outside its environment
    assert build_backend._has_tool("frtool-fine")
    assert not build_backend._has_tool("frtool-absent")
