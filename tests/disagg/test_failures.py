"""Aborts, a dying decode side, a full pool and malformed frames."""

from __future__ import annotations

import json
import signal
import time

import pytest

import ipc
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.sender import KVPoll
from tests.disagg.helpers import (
    PAGE,
    DecodeProc,
    FakeReq,
    Prompt,
    Router,
    bootstrap,
    free_port,
    send_chunks,
    wait_state,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_prefill_segments")]
DONE = (KVPoll.Success, KVPoll.Failed)


@pytest.fixture
def backend(pool, decode):
    b = make_transfer("shm", pool[0], PAGE, decode.address, bootstrap_timeout=10.0)
    yield b
    b.close()


def test_prefill_abort_mid_transfer_frees_the_room(pool, backend, router, room):
    _, prompts = pool
    p, r = prompts[2], room()  # 47 tokens: 3 pages
    router.register("ab", r, p.ids)
    s = backend.create_sender(FakeReq("ab", r, len(p.ids)))
    bootstrap(s, p)
    s.send(p.pages[:1], last=False)
    s.abort()
    assert s.poll() == KVPoll.Failed and s.failure_reason() == "aborted"
    s.send(p.pages[1:], last=True, first_token=1)  # ignored once failed
    reply = router.recv()
    assert reply == {"rid": "ab", "status": "error", "error": "aborted"}
    router.register("again", r, p.ids)  # the room is free again
    s2 = backend.create_sender(FakeReq("again", r, len(p.ids)))
    bootstrap(s2, p)
    send_chunks(s2, p)
    assert wait_state(s2, DONE) == KVPoll.Success
    assert router.recv()["status"] == "done"


def test_router_abort_fails_the_sender(pool, backend, router, room):
    _, prompts = pool
    p, r = prompts[0], room()
    router.register("rab", r, p.ids)
    s = backend.create_sender(FakeReq("rab", r, len(p.ids)))
    bootstrap(s, p)
    s.send(p.pages[:1], last=False)
    router.send({"type": "abort", "room": r})
    assert router.recv() == {"rid": "rab", "status": "error", "error": "aborted"}
    assert wait_state(s, DONE) == KVPoll.Failed
    assert "decode side" in s.failure_reason()


def test_full_pool_queues_registrations(pool, room):
    _, prompts = pool
    p = prompts[0]  # 3 pages; the pool holds 4
    d = DecodeProc(max_total_tokens=4 * PAGE).wait_ready()
    b = make_transfer("shm", pool[0], PAGE, d.address, bootstrap_timeout=10.0)
    try:
        with Router(d.address) as rt:
            ra, rb = room(), room()
            rt.register("a", ra, p.ids)
            rt.register("b", rb, p.ids)
            rt.register("huge", room(), [1] * (5 * PAGE))
            assert rt.recv()["rid"] == "huge"  # can never fit: refused at once
            sa, sb = (b.create_sender(FakeReq(n, r, len(p.ids))) for n, r in (("a", ra), ("b", rb)))
            bootstrap(sa, p)
            time.sleep(0.3)
            assert sb.poll() == KVPoll.Bootstrapping  # "unknown" until pages free
            send_chunks(sa, p)
            assert rt.recv()["rid"] == "a"
            bootstrap(sb, p)
            send_chunks(sb, p)
            done = rt.recv()
            assert done.pop("emitted_at") <= time.monotonic()  # the decode's first-token stamp
            assert done == rt_done("b", p)
    finally:
        b.close()
        assert not d.close()


def rt_done(rid: str, p: Prompt) -> dict:
    return {
        "rid": rid,
        "status": "done",
        "first_token": p.first_token,
    }  # not verified: the router reply leaves null keys out


def test_a_decode_that_never_acks_fails_the_sender(pool, room):
    """The decode side answers pings and the bootstrap but holds the ack past the deadline."""
    _, prompts = pool
    p, r = prompts[0], room()
    d = DecodeProc(delay_ms=20000).wait_ready()
    b = make_transfer("shm", pool[0], PAGE, d.address, bootstrap_timeout=1.0)
    try:
        with Router(d.address) as rt:
            rt.register("slow", r, p.ids)
            s = b.create_sender(FakeReq("slow", r, len(p.ids)))
            bootstrap(s, p)
            send_chunks(s, p)
            sent = time.monotonic()
            assert wait_state(s, DONE, timeout=5) == KVPoll.Failed
            assert time.monotonic() - sent >= 1.0
            assert s.failure_reason() == "no answer from the decode side within 1.0s"
            assert rt.recv() == {"rid": "slow", "status": "error", "error": "aborted"}
    finally:
        b.close()
        assert not d.close()


def test_decode_killed_mid_run(pool, room):
    kv, prompts = pool
    d = DecodeProc().wait_ready()
    b = make_transfer("shm", kv, PAGE, d.address, bootstrap_timeout=10.0, dead_timeout=1.5)
    try:
        with Router(d.address) as rt:
            senders = []
            for i, p in enumerate(q for q in prompts if q.num_pages > 1):
                r = room()
                rt.register(f"k{i}", r, p.ids)
                s = b.create_sender(FakeReq(f"k{i}", r, len(p.ids)))
                bootstrap(s, p)
                s.send(p.pages[:1], last=False)
                senders.append(s)
            later = b.create_sender(FakeReq("late", room(), 20))  # still bootstrapping
            d.stop(signal.SIGKILL)
            t0 = time.monotonic()
            for s in [*senders, later]:
                assert wait_state(s, DONE, timeout=6) == KVPoll.Failed
            assert time.monotonic() - t0 < 5
            assert "silent" in senders[0].failure_reason()
    finally:
        b.close()
    # SIGKILL leaves the segment; a starting decode (or this sweep) removes it. Another decode
    # starting meanwhile may already have swept it, so only the end state is checked.
    ipc.sweep_stale("mppdecode")
    assert not ipc.list_segments(d.prefix)
    d.close()


def test_malformed_frames_get_errors_and_service_goes_on(decode, router, room):
    bad = [
        (b"not json", None),
        (b"[1, 2]", None),
        (json.dumps({"type": "warp"}).encode(), None),
        (json.dumps({"type": "bootstrap", "room": "x"}).encode(), None),
        (json.dumps({"type": "transfer_done", "room": 77}).encode(), 77),
        (json.dumps({"type": "register", "rid": "m1", "bootstrap_room": -3}).encode(), "m1"),
        (
            json.dumps(
                {"type": "register", "rid": "m2", "bootstrap_room": 5, "input_ids": []}
            ).encode(),
            "m2",
        ),
        (json.dumps({"type": "ack", "room": 1, "ok": True}).encode(), None),  # not for decode
    ]
    for frame, ident in bad:
        router.send_raw(frame)
        reply = router.recv()
        if isinstance(ident, str):
            assert reply["rid"] == ident and reply["status"] == "error", reply
        else:
            assert reply["type"] == "error" and reply.get("room") == ident, reply
    router.send_raw(b"{}", b"extra frame")
    assert router.recv() == {"type": "error", "error": "one JSON frame per message", "room": None}
    router.send({"type": "abort", "room": room()})
    assert router.recv()["type"] == "error"
    router.send({"type": "ping"})
    assert router.recv() == {"type": "pong"}


def test_sigterm_shuts_down_cleanly():
    d = DecodeProc().wait_ready()
    assert ipc.list_segments(d.prefix)
    assert d.stop(signal.SIGTERM) == 0, d.output()
    assert not d.close()


def test_backend_reattaches_to_a_restarted_decode(pool, room):
    kv, prompts = pool
    p, port = prompts[3], free_port()
    b = None
    try:
        for attempt in range(2):
            d = DecodeProc(port=port).wait_ready()
            b = b or make_transfer("shm", kv, PAGE, d.address, dead_timeout=30.0)
            with Router(d.address) as rt:
                r = room()
                rt.register(f"re{attempt}", r, p.ids)
                s = b.create_sender(FakeReq(f"re{attempt}", r, len(p.ids)))
                bootstrap(s, p)
                send_chunks(s, p)
                assert wait_state(s, DONE) == KVPoll.Success, s.failure_reason()
                assert rt.recv()["status"] == "done"
            assert not d.close()
    finally:
        if b is not None:
            b.close()
