"""Backpressure: a queue cap answered at once with "overloaded"; memory flat for a client
that never reads its replies, whose requests are still released."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from tests.reliability.helpers import dealer, rss_kb

pytestmark = pytest.mark.timeout(120)
FAKE = ("--forward-mode", "proc-ahead", "--disaggregation-transfer-backend", "fake")


def test_requests_beyond_the_cap_get_overloaded_at_once(serve):
    srv = serve(
        *FAKE,
        *("--max-queued-requests", "8", "--max-running-requests", "1"),
        *("--chunked-prefill-size", "16", "--worker-threads", "1"),
    )
    client = srv.client()
    rids = [f"q{i}" for i in range(60)]
    t0 = time.monotonic()
    for i, rid in enumerate(rids):
        client.generate(rid, [(i * 31 + j) % 4000 + 1 for j in range(300)])
    replies, first_overloaded = {}, None
    while len(replies) < len(rids):
        r = client.recv(60)
        replies[r["rid"]] = r
        if r.get("error") == "overloaded" and first_overloaded is None:
            first_overloaded = time.monotonic() - t0
    overloaded = [r for r in replies.values() if r.get("error") == "overloaded"]
    done = [r for r in replies.values() if r["status"] == "done"]
    assert len(overloaded) + len(done) == len(rids)
    assert len(done) <= 9  # the cap holds within one poll of the socket too
    assert first_overloaded is not None and first_overloaded < 2.0  # immediate, not queued
    client.close()


def _wave(sock: zmq.Socket, start: int, n: int) -> None:
    pad = "x" * 240  # ~300-byte replies
    for i in range(start, start + n):
        sock.send(json.dumps({"type": "nope", "rid": f"{i}-{pad}"}).encode())


def _wait_counter(client, name: str, value: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["counters"][name] >= value or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_memory_stays_flat_when_replies_are_never_read(serve):
    srv = serve(*FAKE, "--log-level", "warning")
    lazy, probe = dealer(srv.port), srv.client()  # `lazy` never reads a reply
    lazy.setsockopt(zmq.RCVHWM, 100)
    wave, sent = 20_000, 0
    for _ in range(2):  # fill every queue on the way first
        _wave(lazy, sent, wave)
        sent += wave
        _wait_counter(probe, "bad_frames", sent)
    base = rss_kb(srv.pid)
    for _ in range(4):
        _wave(lazy, sent, wave)
        sent += wave
        stats = _wait_counter(probe, "bad_frames", sent)
    grown_kb = rss_kb(srv.pid) - base
    assert stats["counters"]["bad_frames"] == sent
    assert stats["counters"]["replies_dropped"] > 2 * wave  # dropped, not queued
    assert grown_kb < 16 * 1024, f"RSS grew {grown_kb} kB over {4 * wave} ignored replies"
    assert "dropped a reply" in srv.output()

    finished = stats["counters"]["num_finished"]
    for i in range(100):  # real requests whose replies will be dropped too
        lazy.send(
            json.dumps({"type": "generate", "rid": f"g{i}", "input_ids": [5, i + 1]}).encode()
        )
    stats = _wait_counter(probe, "num_finished", finished + 100)
    assert stats["counters"]["num_finished"] == finished + 100
    assert stats["queues"]["live"] == 0  # released although nobody heard the answer
    assert stats["req_slots"]["free"] == stats["req_slots"]["total"]
    lazy.close(linger=0)
    probe.close()
