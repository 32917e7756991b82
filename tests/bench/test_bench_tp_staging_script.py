"""`scripts/bench_tp_staging.py` measures both designs at every point it was asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tp_staging.py"
DESIGNS = ("shared", "per_rank")


def test_one_tp_and_batch_size_gives_a_row_of_positive_numbers(tmp_path):
    out = tmp_path / "tp.json"
    flags = ["--iters", "3", "--tp", "2", "--tokens", "512", "--json", str(out)]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=50)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["tp"], row["tokens"]) == (2, 512)
    assert row["reqs"] >= 1 and row["kv"] >= row["tokens"]
    assert 0 < row["batch_bytes"] <= result["slot_bytes"]
    for key in ("write_us", "read_us", "wall_us"):
        assert set(row[key]) == set(DESIGNS)
        assert all(row[key][d] > 0 for d in DESIGNS), row
    cells = [[c.strip() for c in line.split("|")] for line in stdout.splitlines()]
    assert [c[:2] for c in cells if len(c) == 7 and c[0] != "tp"] == [["2", "512"]], stdout
    assert not list(Path("/dev/shm").glob(f"mppbench_{proc.pid}_*")), "slots left behind"
