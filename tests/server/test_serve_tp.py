"""`mpprefill serve --tp-size 2` (CPU ranks over gloo): the offline engine's first tokens,
and a SIGKILL of one idle rank ends the server with an error, nothing left behind."""

from __future__ import annotations

import os
import signal

import pytest

from mpprefill.engine import PrefillEngine
from tests.worker.helpers import rank_pids

pytestmark = pytest.mark.timeout(240)


def test_tp2_serve_matches_offline_and_fails_on_a_dead_rank(server_factory):
    prompts = [[1, 2, 3] * 30, [1, 2, 3] * 20 + [9] * 7, [5] * 70]
    srv = server_factory(
        "--forward-mode", "proc-ahead", "--tp-size", "2", "--chunked-prefill-size", "32"
    )
    for i, p in enumerate(prompts):
        srv.client.generate(f"r{i}", p)
    replies = srv.client.recv_until({f"r{i}" for i in range(3)})
    with PrefillEngine(forward_mode="normal", chunked_prefill_size=32) as eng:
        ref = eng.prefill(prompts)
    for i, o in enumerate(ref):
        assert replies[f"r{i}"]["status"] == "done", replies[f"r{i}"]
        assert replies[f"r{i}"]["first_token"] == o.first_token
    ranks = rank_pids(srv.proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)  # idle: only the group's sentinel can tell
    rc = srv.proc.wait(30)
    assert rc != 0
    assert "forward worker failed" in srv.log()
    assert srv.shm_left() == []
    assert not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in ranks)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
