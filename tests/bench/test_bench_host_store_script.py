"""`scripts/bench_host_store.py`'s staging table runs where the batch fills the pools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_host_store.py"


def test_staging_table_of_a_batch_as_large_as_the_pool(tmp_path):
    """8 finishing prompts of 128 tokens fill a 1,024-token pool, and an SWA model's pool is
    a fraction of that: the table sizes its pools for the batch instead of failing."""
    out = tmp_path / "host.json"
    flags = ["--skip-e2e", "--models", "dense,swa", "--staging-reqs", "1,8"]
    flags += ["--prompt-len", "128", "--max-total-tokens", "1024", "--staging-batches", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"dense", "swa"}
    for model in models.values():
        rows = model["staging"]
        assert [r["finishing_reqs"] for r in rows] == [1, 8]
        for row in rows:
            for path in ("batched", "per_request"):
                assert row[path]["plan_ms"] > 0 and row[path]["copy_ms"] > 0, row
