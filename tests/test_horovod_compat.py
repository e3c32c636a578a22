"""scripts/horovod_compat.py on a small suite written like Horovod's test_torch.py."""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import os
import sys
import time
import unittest

import torch

import horovod.torch as hvd
from horovod.torch.mpi_ops import synchronize

sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))

from common import in_thread, mock


class TorchTests(unittest.TestCase):
    def test_allreduce_sums(self):
        hvd.init()
        got = synchronize(hvd.allreduce_async(torch.ones(3), op=hvd.Sum))
        assert torch.equal(got, torch.full((3,), float(hvd.size())))
        assert callable(in_thread) and mock.MagicMock is not None

    def test_fails_on_rank_one(self):
        hvd.init()
        assert hvd.rank() != 1, "rank one refuses"

    def test_skipped_everywhere(self):
        self.skipTest("nothing to do here")

    def test_hangs_on_rank_zero(self):
        hvd.init()
        if hvd.rank() == 0:
            time.sleep(600)
'''

HELPER = '''
import contextlib
import mock
from horovod.runner.util.threads import in_thread
'''


def test_compat_script_reports_pass_fail_skip_and_timeout_per_test(tmp_path):
    (tmp_path / "parallel").mkdir()
    (tmp_path / "utils").mkdir()
    suite = tmp_path / "parallel" / "test_torch.py"
    suite.write_text(textwrap.dedent(SUITE))
    (tmp_path / "utils" / "common.py").write_text(textwrap.dedent(HELPER))
    report = tmp_path / "compat.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "horovod_compat.py"),
                           str(suite), "-np", "2", "--timeout", "25", "-o", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr  # some tests failed
    text = report.read_text()
    assert "| 2 | 4 | 1 | 2 | 1 |" in text, text
    assert "`test_fails_on_rank_one` | 2 | rank 1: AssertionError: rank one refuses" in text
    assert "`test_hangs_on_rank_zero` | 2 | timeout after 25 s" in text
    assert "`test_skipped_everywhere` | 2 | nothing to do here" in text
    assert "horovod_compat.py" in text and "-np 2" in text
