"""The bench refuses to report runs whose numbers mean nothing; a sliding-window model
benches end to end with the decode side verifying every window."""

from __future__ import annotations

import json

import pytest

from mpprefill.bench.commands import run_problems
from mpprefill.bench.suite import _median_run
from tests.bench.test_bench_e2e import _mpprefill


def _run(**kw) -> dict:
    run = {"mode": "proc", "num_failed": 0, "num_unverified": 0, "leaks": {"ok": True}}
    return {**run, **kw}


def test_run_problems_names_every_bad_run():
    assert run_problems({"runs": [_run(), _run(mode="normal")]}) == []
    bad = run_problems({"runs": [_run(num_failed=2), _run(mode="x", num_unverified=1)]})
    assert bad == ["proc: 2 failed requests", "x: 1 replies failed --verify"]
    sweep = {"points": [{"runs": [_run()]}, {"runs": [_run(leaks={"ok": False})]}]}
    assert len(run_problems(sweep)) == 1 and "leaks" in run_problems(sweep)[0]


@pytest.mark.timeout(400)
def test_sliding_window_bench_verifies_on_the_decode_side(tmp_path):
    path = tmp_path / "bench.json"
    _mpprefill(
        "bench",
        "--modes",
        "proc-ahead",
        "--num-requests",
        "12",
        "--prompt-len",
        "160",
        "--chunked-prefill-size",
        "64",
        "--sliding-window",
        "32",
        "--swa-layers",
        "sf",
        "--verify",
        "--json",
        str(path),
    )
    (run,) = json.loads(path.read_text())["runs"]
    assert run["num_finished"] == 12 and run["num_unverified"] == 0 and run["leaks"]["ok"]
    assert json.loads(path.read_text())["config"]["server"]["sliding_window"] == 32
    swa = run["kv_at_end"]["swa"]
    assert swa["free_tokens"] + swa["cached_tokens"] == swa["total_tokens"] > 0


def test_the_median_run_carries_every_trial_under_the_contracts_name():
    trials = [_run(uncached_itps=v) for v in (300.0, 100.0, 200.0)]
    run = _median_run(trials)
    assert run["uncached_itps"] == 200.0
    assert run["trials"] == run["uncached_itps_trials"] == [300.0, 100.0, 200.0]


def test_each_run_gets_the_gil_interval_and_the_emulated_host_knobs():
    """The bench's serve command lines carry the switch interval, the attention backend
    and, on the emulated device, its launch cost and issue control."""
    from mpprefill.bench.runner import BenchConfig
    from mpprefill.config import ServerArgs

    server = ServerArgs(
        device="emulated",
        emulate_model="Llama-3.1-8B",
        emulate_launch_us=7.5,
        emulate_issue="free",
        switch_interval_ms=0.5,
    )
    flags = BenchConfig(server, ["proc-ahead"]).server_flags("proc-ahead", None)
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--switch-interval-ms"] == "0.5"
    assert pairs["--emulate-launch-us"] == "7.5" and pairs["--emulate-issue"] == "free"
    assert pairs["--emulate-model"] == "Llama-3.1-8B" and pairs["--attention-backend"] == "auto"
    cpu = BenchConfig(ServerArgs(), ["proc"]).server_flags("proc", None)
    assert "--emulate-launch-us" not in cpu and "--switch-interval-ms" in cpu


def test_serve_sets_the_switch_interval_before_it_serves(monkeypatch):
    import sys

    from mpprefill.config import ServerArgs
    from mpprefill.server import server as srv

    seen = []

    class Stub:
        def __init__(self, args):
            seen.append(("built", sys.getswitchinterval()))

        def serve_forever(self):
            return 0

    before = sys.getswitchinterval()
    monkeypatch.setattr(srv, "PrefillServer", Stub)
    try:
        assert srv.run_serve(ServerArgs(switch_interval_ms=2.5)) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [("built", pytest.approx(0.0025))]
