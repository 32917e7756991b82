"""The restart legs' and the soak's arithmetic: time to recovery, growth after the warm-up,
and what a server's stats say it still holds (scripts/chaoslib, scripts/soak.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from chaoslib.deploy import ROUTER_FLAGS, leftover  # noqa: E402
from chaoslib.restarts import recovery  # noqa: E402
from chaoslib.workload import Record  # noqa: E402
from soak import growth  # noqa: E402


def rec(t_send: float, took: float, ok: bool) -> Record:
    r = Record(f"r{t_send}", [1], -1, "router", via="router", t_send=t_send)
    r.t_reply = t_send + took
    r.replies.append({"status": "done"} if ok else {"status": "error", "error": "502"})
    return r


def test_recovery_is_the_send_of_the_first_request_after_which_every_one_succeeded():
    recs = [
        rec(9.0, 0.1, False),  # before the kill at 10: not counted
        rec(10.2, 0.1, True),
        rec(10.5, 0.2, False),
        rec(11.0, 6.0, False),
        rec(11.5, 9.0, True),  # slow, but answered
        rec(12.0, 0.1, True),
    ]
    assert recovery(recs, 10.0) == 11.5
    assert recovery(recs[:3], 10.0) is None  # the last request failed: not recovered
    assert recovery([rec(10.1, 0.1, True)], 10.0) == 10.1


def test_growth_compares_the_readings_after_the_warmup_with_the_last_ones():
    # one process: RSS 100 KiB through the warm-up (t < 20), then 200, 200, 202, ..., 212
    rss = [100, 100, 200, 200, 202, 204, 206, 208, 210, 212]
    samples = [{"t": 10.0 * i, "procs": {"p": [v, 10 + (i >= 8)]}} for i, v in enumerate(rss)]
    g = growth(samples, warmup_s=20.0, limit=0.05)
    # first three after the warm-up: 200, 200, 202; last three: 208, 210, 212
    assert g["p"]["rss_kib"] == [201, 210, round((210 - 602 / 3) / (602 / 3), 4)]
    # fds: 10, 10, 10 then 11, 11, 10 ... the last three are 10, 11, 11
    assert g["p"]["fds"] == [10, 11, round((32 / 3 - 10) / 10, 4)]
    assert g["p"]["ok"] is False  # fds grew 6.7%
    assert growth(samples, warmup_s=20.0, limit=0.05, fd_slack=1)["p"]["ok"] is True  # +0.67
    assert growth(samples, warmup_s=0.0, limit=0.1)["p"]["ok"] is False  # rss 100 -> 210
    assert growth(samples[:5], warmup_s=20.0, limit=0.05) == {}  # too few readings to judge


@pytest.mark.parametrize(
    "state, held",
    [
        (
            {
                "load": {"num_reqs": 0, "num_tokens": 0},
                "rooms": 0,
                "pending": 0,
                "requests": 0,
                "free_pages": 1024,
                "num_pages": 1024,
            },
            {},
        ),
        (
            {
                "load": {"num_reqs": 1, "num_tokens": 32},
                "rooms": 2,
                "pending": 0,
                "requests": 1,
                "free_pages": 1020,
                "num_pages": 1024,
            },
            {"num_reqs": 1, "num_tokens": 32, "rooms": 2, "requests": 1, "pages_held": 4},
        ),
        (
            {
                "load": {"num_reqs": 0, "num_tokens": 0},
                "invariants": {"checked": True, "ok": False, "error": "x"},
            },
            {"invariants": "x"},
        ),
        ({}, {"unreachable": True}),
    ],
)
def test_leftover_names_what_a_server_still_holds(state, held):
    assert leftover(state) == held


def test_the_router_flags_are_the_readme_and_launch_sh_ones():
    """The README's router command and scripts/launch.sh's router line carry the settings the
    restart legs and the soak run with."""
    readme = (SCRIPTS.parent / "README.md").read_text()
    launch = (SCRIPTS / "launch.sh").read_text()
    flat = lambda text: " ".join(text.replace("\\\n", " ").split())  # noqa: E731
    line = " ".join(ROUTER_FLAGS)
    assert line in flat(readme)
    assert line in flat(launch)


def test_the_restart_legs_are_skipped_with_their_reason_without_sglang_router(tmp_path):
    code = (
        "import sys; sys.modules['sglang_router'] = None; "
        f"sys.path.insert(0, {str(SCRIPTS)!r}); import chaos; "
        f"sys.exit(chaos.main(['--restart-legs', 'only', '--log-dir', {str(tmp_path)!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "restart legs: skipped (sglang_router is not importable" in out.stdout
    assert "chaos: PASS" in out.stdout
