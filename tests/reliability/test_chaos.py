"""A short seeded run of scripts/chaos.py: serve + decode under load with every fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def test_short_chaos_run_passes_every_check(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(SCRIPT), "--duration", "20", "--num-requests", "260"]
    cmd += ["--seed", "11", "--max-queued-requests", "48", "--json", str(out)]
    cmd += ["--log-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=190)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, f"{failed}\n{summary['problems'][:10]}\n{run.stdout[-3000:]}"
    assert run.returncode == 0
    faults = summary["faults"]
    for kind in ("bad-frame", "decode-kill-restart", "slow-transfer", "burst", "worker-sigkill"):
        assert faults.get(kind), (kind, faults)
    assert sum(v for k, v in faults.items() if k.startswith("abort/") and k != "abort/too-late")
    counts = summary["replies"]["counts"]
    assert counts.get("done") and counts.get("error:overloaded")  # the burst hit the cap
