"""A few seconds of scripts/soak.py: the router over a prefill and two decodes under the mixed
load; it runs, reads every process from /proc, checks each reply against the offline engine
and reports (too short to judge growth)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang_router", reason="needs the sglang-router package")
pytestmark = pytest.mark.timeout(150)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
PROCS = {"router", "prefill", "prefill-forward", "prefill-front", "decode0", "decode1"}


def test_a_short_soak_runs_and_reports(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SCRIPT), "--minutes", "0.05", "--interval", "1"]
    cmd += ["--json", str(out), "--log-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads(out.read_text())
    assert run.returncode == 0, (s["checks"], s["errors"], run.stdout[-2000:])
    assert not s["judged"] and "growth: not judged" in run.stdout
    assert len(s["samples"]) >= 3  # t = 0, 1, 2, 3
    assert set(s["samples"][0]["procs"]) >= PROCS
    rss, fds = s["samples"][-1]["procs"]["prefill"]
    assert rss > 10_000 and fds > 3  # KiB and descriptors of a live server
    assert s["tokens"]["checked"] > 0 and not s["tokens"]["wrong"]
    assert s["held_after_drain"] == {"prefill": {}, "decode0": {}, "decode1": {}}
    assert "soak: PASS" in run.stdout
