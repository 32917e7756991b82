"""`mpprefill bench` and `mpprefill profile` end to end, small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

RUN_FIELDS = {
    "mode",
    "uncached_itps",
    "total_itps",
    "cache_hit_rate",
    "num_requests",
    "num_finished",
    "num_failed",
    "duration_s",
    "ttft_ms",
    "worker_busy_frac",
    "num_batches",
    "mailbox_bytes_per_batch",
    "first_tokens_sha256",
    "leaks",
    "device",
    "t_sched_ms",
    "t_issue_ms",
    "t_device_ms",
    "device_busy_frac",
    "handoff_gap_ms",
    "ttft_decode_p50_ms",
    "ttft_decode_p99_ms",
}


def _mpprefill(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "mpprefill", *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_bench_json_has_the_contract_fields_and_adds_up(tmp_path):
    path = tmp_path / "bench.json"
    out = _mpprefill(
        "bench",
        "--modes",
        "normal,proc-ahead",
        "--num-requests",
        "12",
        "--prompt-len",
        "160",
        "--chunked-prefill-size",
        "64",
        "--json",
        str(path),
    )
    result = json.loads(path.read_text())
    assert result["forward_bound_itps"] > 0
    assert [r["mode"] for r in result["runs"]] == ["normal", "proc-ahead"]
    for run in result["runs"]:
        assert run.keys() >= RUN_FIELDS
        assert set(run["ttft_ms"]) == {"p50", "p99"}
        assert 0 < run["ttft_decode_p50_ms"] <= run["ttft_decode_p99_ms"]  # a real decode
        assert set(run["mailbox_bytes_per_batch"]) == {"mean", "max"}
        assert run["num_finished"] + run["num_failed"] == run["num_requests"] == 12
        assert run["num_failed"] == 0 and run["leaks"]["ok"]
        assert run["uncached_tokens"] + run["cached_tokens"] == run["prompt_tokens"]
        assert run["uncached_itps"] <= run["total_itps"]
        assert 0 <= run["cache_hit_rate"] <= 1 and run["num_batches"] > 0
    normal, proc = result["runs"]
    assert normal["first_tokens_sha256"] == proc["first_tokens_sha256"]
    assert normal["mailbox_bytes_per_batch"]["max"] == 0  # no process boundary
    assert 0 < proc["mailbox_bytes_per_batch"]["max"] < 4096
    assert "proc-ahead" in out.stdout and "forward bound" in out.stdout


def test_emulated_sweep_point_labels_its_device_and_times_the_device(tmp_path):
    path = tmp_path / "bench.json"
    out = _mpprefill(
        "bench",
        "--device",
        "emulated",
        "--emulate-model",
        "Llama-3.1-8B",
        "--modes",
        "thread-ahead,proc-ahead",
        "--num-requests",
        "16",
        "--prompt-len",
        "256",
        "--chunked-prefill-size",
        "128",
        "--json",
        str(path),
    )
    result = json.loads(path.read_text())
    assert "device: emulated (h200, Llama-3.1-8B)" in out.stdout
    for run in result["runs"]:
        assert run["device"] == "emulated (h200, Llama-3.1-8B)"
        assert run["num_failed"] == 0 and run["leaks"]["ok"]
        assert run["t_device_ms"] > 0 and 0 < run["device_busy_frac"] <= 1
        assert run["handoff_batches"] > 0 and run["handoff_gap_ms"] >= 0
    thread, proc = result["runs"]
    assert thread["first_tokens_sha256"] == proc["first_tokens_sha256"]


def _submits_ahead(trace: Path) -> bool:
    """Whether some batch k + 1 was submitted before batch k's results were processed."""
    events = json.loads(trace.read_text())["traceEvents"]
    start = {
        (e["name"], e["args"]["seq"]): e["ts"]
        for e in events
        if e.get("ph") == "X" and e["name"] in ("submit", "process") and "seq" in e.get("args", {})
    }
    assert sum(name == "process" for name, _ in start) > 1, f"{trace}: too few batches"
    return any(
        ("submit", seq + 1) in start and start[("submit", seq + 1)] < t
        for (name, seq), t in start.items()
        if name == "process"
    )


def test_profile_traces_both_processes_and_reports_overlap(tmp_path):
    out_dir = tmp_path / "prof"
    _mpprefill(
        "profile",
        "--forward-mode",
        "normal,proc-ahead",
        "--num-requests",
        "24",
        "--prompt-len",
        "384",
        "--out-dir",
        str(out_dir),
    )
    report = json.loads((out_dir / "summary.json").read_text())
    assert report["normal"]["summary"]["overlap_frac"] == 0.0  # the forward is inline
    assert 0.0 <= report["proc-ahead"]["summary"]["overlap_frac"] <= 1.0
    # NOTE: how much scheduler work lands inside a forward depends on who the OS runs first;
    # what proc-ahead does by design is submit the next batch before processing the last
    assert _submits_ahead(out_dir / "proc-ahead.trace.json")
    assert not _submits_ahead(out_dir / "normal.trace.json")
    events = json.loads((out_dir / "proc-ahead.trace.json").read_text())["traceEvents"]
    names_by_pid: dict[int, set] = {}
    for e in events:
        if e.get("ph") == "X":
            names_by_pid.setdefault(e["pid"], set()).add(e["name"])
    assert len(names_by_pid) >= 2  # scheduler and forward process
    assert any("forward" in n for n in names_by_pid.values())
    assert any({"build", "process", "collect-wait"} <= n for n in names_by_pid.values())
    pytest.importorskip("matplotlib", reason="the timeline needs the plot extra")
    assert (out_dir / "timeline.png").stat().st_size > 1000


def test_bench_through_the_http_front_reports_its_cost(tmp_path):
    """A tiny run: every request answered through the front, the same first tokens as on
    ZeroMQ, and the front's cost reported."""
    pytest.importorskip("fastapi")
    path = tmp_path / "bench.json"
    out = _mpprefill(
        *("bench", "--front", "http", "--modes", "normal", "--num-requests", "8"),
        *("--prompt-len", "64", "--disaggregation-transfer-backend", "fake"),
        *("--json", str(path)),
    )
    result = json.loads(path.read_text())
    (zmq_run,), (http_run,) = result["runs"], result["http_runs"]
    assert (zmq_run["front"], http_run["front"]) == ("zmq", "http")
    assert http_run["num_finished"] == http_run["num_requests"] == 8
    assert http_run["leaks"]["ok"], http_run["leaks"]
    assert http_run["first_tokens_sha256"] == zmq_run["first_tokens_sha256"]
    (cost,) = result["front_cost"]
    assert cost["http_over_zmq"] == http_run["uncached_itps"] / zmq_run["uncached_itps"]
    assert "HTTP front, normal:" in out.stdout
