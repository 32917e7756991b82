"""A short seeded chaos run with layer-wise KV send on: the decode receiver SIGKILLed and
restarted, slow transfers, aborts at every stage and the forward process killed, while
each batch's pages leave layer by layer. Part of the load goes through SGLang's router to a
generating decode, whose tokens after the first are read off the KV that arrived."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def test_short_chaos_run_with_layerwise_send_passes_every_check(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(SCRIPT), "--duration", "6", "--num-requests", "90"]
    cmd += ["--seed", "23", "--max-queued-requests", "32", "--router-fraction", "0.3"]
    cmd += ["--disaggregation-layerwise-send", "--json", str(out), "--log-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=190)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["layerwise_send"] is True
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, f"{failed}\n{summary['problems'][:10]}\n{run.stdout[-3000:]}"
    assert run.returncode == 0
    faults = summary["faults"]
    for kind in ("decode-kill-restart", "slow-transfer", "worker-sigkill"):
        assert faults.get(kind), (kind, faults)
    assert summary["replies"]["counts"].get("done")
    router = summary["router"]  # the decode generated on the KV that arrived: checked
    if "skipped" not in router:  # token by token against the offline engine
        assert router["ok"] > 0 and router["wrong"] == 0, router
    assert not any(summary["leaks"].values()), summary["leaks"]
