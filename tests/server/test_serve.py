"""`mpprefill serve` with the fake transfer backend: protocol, bad input, shutdown."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mpprefill.bench.procs import worker_pid
from mpprefill.engine import PrefillEngine

pytestmark = pytest.mark.timeout(240)


def test_requests_done_and_match_offline(server_factory):
    prompts = [[1, 2, 3] * 30, [1, 2, 3] * 20 + [9] * 7, [5] * 33]
    srv = server_factory("--forward-mode", "proc-ahead", "--chunked-prefill-size", "32")
    for i, p in enumerate(prompts):
        srv.client.generate(f"r{i}", p)
    replies = srv.client.recv_until({f"r{i}" for i in range(3)})
    with PrefillEngine(forward_mode="normal", chunked_prefill_size=32) as eng:
        ref = eng.prefill(prompts)
    for i, o in enumerate(ref):
        r = replies[f"r{i}"]
        assert r["status"] == "done", r
        assert (r["first_token"], r["prompt_tokens"]) == (o.first_token, o.prompt_tokens)
    stats = srv.client.stats()
    assert (
        stats["queues"]["live"] == 0 and stats["req_slots"]["free"] == stats["req_slots"]["total"]
    )
    assert srv.stop() == 0
    assert srv.shm_left() == []


BAD_FRAMES = [
    (b"not json at all", None, "not JSON"),
    (b'{"type": "launch", "rid": "u1"}', "u1", "$.type"),
    (b'{"type": "generate", "rid": "m1"}', "m1", "input_ids"),
    (b'{"type": "generate", "rid": "m2", "input_ids": "abc"}', "m2", "input_ids"),
    (b'{"type": "generate", "rid": "m3", "input_ids": [1, true]}', "m3", "input_ids"),
    (b'{"type": "generate", "rid": "e1", "input_ids": []}', "e1", "empty"),
    (b'{"type": "generate", "rid": "v1", "input_ids": [1, 99999]}', "v1", "vocabulary"),
    (
        b'{"type": "generate", "rid": "s1", "input_ids": [1], "sampling_params": {"top_p": 0}}',
        "s1",
        "top_p",
    ),
    (b'{"type": "abort", "rid": "nobody"}', "nobody", "unknown rid"),
    (b"[1, 2, 3]", None, "Expected `object`"),
]


def test_bad_input_gets_error_replies_and_server_keeps_serving(server_factory):
    srv = server_factory("--forward-mode", "proc", "--max-total-tokens", "1024")
    for frame, rid, why in BAD_FRAMES:
        srv.client.send_raw(frame)
        reply = srv.client.recv(30)
        assert reply["status"] == "error" and reply["rid"] == rid, (frame, reply)
        assert why in reply["error"], (frame, reply)
    srv.client.generate("long", [1] * 2000)
    assert "KV pool" in srv.client.recv(30)["error"]
    srv.client.generate("ok1", [4] * 600)
    srv.client.generate("ok1", [4] * 10)  # duplicate while the first is live
    replies = [srv.client.recv(60), srv.client.recv(60)]
    assert sorted(r["status"] for r in replies) == ["done", "error"]
    assert any("duplicate" in r.get("error", "") for r in replies)
    stats = srv.client.stats()
    assert stats["kv"]["free_tokens"] + stats["kv"]["cached_tokens"] == stats["kv"]["total_tokens"]
    assert srv.stop() == 0
    assert srv.shm_left() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_answers_pending_and_exits_clean(server_factory, sig):
    srv = server_factory(
        "--forward-mode",
        "proc-ahead",
        "--chunked-prefill-size",
        "16",
        "--max-running-requests",
        "1",
    )
    rids = {f"p{i}" for i in range(200)}
    for i, rid in enumerate(sorted(rids)):  # distinct prompts: no cache hits to speed it up
        srv.client.generate(rid, [(i * 7 + j) % 4000 + 1 for j in range(400)])
    time.sleep(0.5)
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(10) == 0 and time.monotonic() - t0 < 5.0
    replies = srv.client.recv_until(rids, timeout=10)  # every request got one answer
    statuses = {r["status"] for r in replies.values()}
    assert statuses <= {"done", "error"} and "error" in statuses
    assert all("shutting down" in r["error"] for r in replies.values() if r["status"] == "error")
    assert srv.shm_left() == []


def test_mode_conflict_is_a_clear_startup_error(server_factory):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpprefill",
            "serve",
            "--forward-mode",
            "proc-ahead",
            "--disable-overlap-schedule",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "disable-overlap-schedule" in out.stderr


def test_worker_death_fails_requests_and_exits_nonzero(server_factory):
    srv = server_factory(
        "--forward-mode",
        "proc-ahead",
        "--chunked-prefill-size",
        "16",
        "--max-running-requests",
        "1",
    )
    rids = {f"w{i}" for i in range(50)}
    for i, rid in enumerate(sorted(rids)):
        srv.client.generate(rid, [(i * 11 + j) % 4000 + 1 for j in range(300)])
    time.sleep(0.5)
    worker = worker_pid(srv.proc.pid)
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    replies = srv.client.recv_until(rids, timeout=30)
    rc = srv.proc.wait(30)
    errors = [r for r in replies.values() if r["status"] == "error"]
    assert rc != 0 and errors
    assert all("worker" in r["error"] for r in errors)
    assert "forward worker failed" in srv.log()
    assert srv.shm_left() == []


def test_sliding_window_serve_matches_offline_and_reports_its_pool(server_factory):
    swa = ("--sliding-window", "24", "--swa-layers", "fs", "--swa-full-tokens-ratio", "0.25")
    prompts = [[7, 1, 2] * 40, [7, 1, 2] * 30 + [5] * 11]
    srv = server_factory("--forward-mode", "proc-ahead", "--chunked-prefill-size", "32", *swa)
    for i, p in enumerate(prompts):
        srv.client.generate(f"w{i}", p)
    replies = srv.client.recv_until({"w0", "w1"})
    kw = dict(sliding_window=24, swa_layers="fs", swa_full_tokens_ratio=0.25)
    with PrefillEngine(forward_mode="normal", chunked_prefill_size=32, **kw) as eng:
        ref = eng.prefill(prompts)
    assert [replies[f"w{i}"]["first_token"] for i in range(2)] == [o.first_token for o in ref]
    kv = srv.client.stats()["kv"]
    assert kv["swa"]["total_tokens"] == kv["total_tokens"] // 4
    assert kv["swa"]["free_tokens"] + kv["swa"]["cached_tokens"] == kv["swa"]["total_tokens"]
    assert 0 < kv["swa"]["cached_tokens"] <= kv["cached_tokens"]
    assert srv.stop() == 0
    assert srv.shm_left() == []
