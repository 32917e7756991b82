"""Without the RDMA libraries the Mooncake package may be installed, yet no engine starts:
every Mooncake test skips then, with the loader's reason, instead of failing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpprefill.disagg.mooncake_backend import unavailable_reason
from tests.no_rdma import MESSAGE, NoRdma

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE_TESTS = (
    "tests/disagg/test_mooncake.py",
    "tests/disagg/test_swa_scheduler.py",
    "tests/server/test_disagg_e2e.py",
    "tests/disagg/test_tp_transfer.py",
)
NUM_MOONCAKE_TESTS = 5  # two in test_mooncake.py, one in (or parameter of) each of the others


def test_missing_library_is_the_reason(monkeypatch):
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoRdma(), *sys.meta_path])
    reason = unavailable_reason()
    assert reason is not None and MESSAGE in reason


@pytest.mark.timeout(300)
def test_every_mooncake_test_skips_without_the_rdma_libraries():
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.no_rdma", "-p", "no:cacheprovider"]
    cmd += ["-q", "-rs", "-k", "mooncake", *MOONCAKE_TESTS]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert re.search(rf"\b{NUM_MOONCAKE_TESTS} skipped\b", summary), out
    assert "passed" not in summary and "failed" not in summary, out
    assert MESSAGE in out, out  # the reason, from -rs
