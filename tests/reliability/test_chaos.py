"""One short seeded run of scripts/chaos.py per module: serve + decode under load with every
fault, part of the load through SGLang's router, the KV leaving layer by layer
(`--disaggregation-layerwise-send`: its pages read while later layers compute, so a fault
lands mid-forward as well); the tests read its summary. Whole-page sends meet their faults
in the other reliability tests (restart legs, worker death, the disaggregated e2e)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpprefill.cli import build_parser
from mpprefill.config import ServerArgs
from mpprefill.flags import from_namespace

pytestmark = pytest.mark.timeout(200)
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
SCRIPT = SCRIPTS / "chaos.py"


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    """(summary, completed process) of one 20 s run."""
    tmp = tmp_path_factory.mktemp("chaos")
    out = tmp / "chaos.json"
    cmd = [sys.executable, str(SCRIPT), "--duration", "20", "--num-requests", "260"]
    cmd += ["--seed", "11", "--max-queued-requests", "48", "--router-fraction", "0.2"]
    cmd += ["--disaggregation-layerwise-send", "--json", str(out), "--log-dir", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=190)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), run


def test_short_chaos_run_passes_every_check(chaos):
    summary, run = chaos
    failed = [name for name, ok in summary["checks"].items() if not ok]
    assert not failed, f"{failed}\n{summary['problems'][:10]}\n{run.stdout[-3000:]}"
    assert run.returncode == 0
    assert summary["layerwise_send"] is True
    faults = summary["faults"]
    for kind in ("bad-frame", "decode-kill-restart", "slow-transfer", "burst", "worker-sigkill"):
        assert faults.get(kind), (kind, faults)
    assert sum(v for k, v in faults.items() if k.startswith("abort/") and k != "abort/too-late")
    counts = summary["replies"]["counts"]
    assert counts.get("done") and counts.get("error:overloaded")  # the burst hit the cap
    assert not any(summary["leaks"].values()), summary["leaks"]


def test_the_router_leg_ran_and_every_reply_was_right(chaos):
    summary, run = chaos
    router = summary["router"]
    if "skipped" in router:
        pytest.skip(f"router leg skipped: {router['skipped']}")
    assert router["sent"] > 0 and router["ok"] > 0 and router["wrong"] == 0, router
    assert router["streamed"] > 0
    assert router["ok"] + router["errors"] == router["sent"], router
    assert summary["checks"]["router leg ran, every reply right"]
    assert f"router leg: errors={router['errors']} ok={router['ok']}" in run.stdout
    assert summary["exits"]["router_sigterm"] == 0


def test_rooms_are_registered_through_the_bootstrap_endpoint(chaos):
    summary, _ = chaos
    registrations = summary["registrations"]
    assert registrations["accepted"] > 0
    assert registrations["refused"] > 0  # rooms of requests the prefill refused (the burst)
    assert summary["checks"]["the bootstrap endpoint refused only rooms of failed requests"]


def test_the_router_leg_is_skipped_with_its_reason_without_sglang_router(tmp_path):
    code = (
        "import sys; sys.modules['sglang_router'] = None; "
        f"sys.path.insert(0, {str(SCRIPTS)!r}); "
        "import chaos; from chaoslib.run import ChaosRun; "
        f"print(ChaosRun(chaos.parse_args([]), {str(tmp_path)!r}).router_skipped)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sglang_router is not importable" in out.stdout


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--tp-size", "2"], {"tp_size": 2}),
        (
            ["--host-store-size", "4096", "--sliding-window", "48"],
            {"host_store_size": 4096, "sliding_window": 48},
        ),
    ],
)
def test_tensor_parallel_and_host_store_runs_pass_their_flags_to_serve(tmp_path, argv, expect):
    """`--tp-size` and `--host-store-size` reach serve's command line, and serve's own
    argument parser takes that command line."""
    code = (
        f"import sys, json; sys.path.insert(0, {str(SCRIPTS)!r}); "
        "import chaos; from chaoslib.run import ChaosRun; "
        f"print(json.dumps(ChaosRun(chaos.parse_args({argv!r}), {str(tmp_path)!r}).serve_flags()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    flags = json.loads(out.stdout.strip().splitlines()[-1])
    parsed = build_parser().parse_args(["serve", "--zmq-port", "1", *flags])
    args = from_namespace(ServerArgs, parsed)
    assert {k: getattr(args, k) for k in expect} == expect
    assert (
        args.mode.in_process and args.forward_mode == "proc-ahead"
    )  # a mode a group of ranks runs in
