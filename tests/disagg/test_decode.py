"""The decode receiver's room bookkeeping, driven in-process by a router and a fake prefill."""

from __future__ import annotations

import time

import pytest

import ipc
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.delay import TransferDelay
from mpprefill.decode.receiver import DecodeReceiver
from tests.disagg.helpers import PAGE, Router, serving, step

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def receiver():
    rx = DecodeReceiver(
        DecodeArgs(receiver_port=0, max_total_tokens=2 * PAGE, register_timeout=0.5)
    )
    segment = rx.pool.shared.handle.name
    with serving(rx):
        yield rx
    assert not ipc.list_segments(segment.lstrip("/"))


@pytest.fixture
def router(receiver):
    with Router(receiver.address) as r:
        yield r


@pytest.fixture
def prefill(receiver):
    with Router(receiver.address) as r:
        yield r


def test_pages_round_up_and_a_full_pool_queues(receiver, router, prefill):
    router.register("a", 1, list(range(PAGE + 1)))  # 17 tokens: 2 pages, the whole pool
    router.register("b", 2, [5])
    router.sync()
    prefill.send({"type": "bootstrap", "room": 1})
    reply = prefill.recv()
    assert reply["status"] == "ready" and len(reply["dst_pages"]) == 2
    assert reply["decode_prefix_len"] == 0 and reply["pool"]["kind"] == "shm"
    prefill.send({"type": "bootstrap", "room": 2})
    assert prefill.recv()["status"] == "unknown"  # queued until pages free
    error = router.recv(timeout=3)
    assert error["rid"] == "b" and "no free receive pages" in error["error"]


def test_wrong_page_count_is_refused(receiver, router, prefill):
    router.register("w", 3, [1] * 20)
    router.sync()
    prefill.send({"type": "bootstrap", "room": 3})
    reply = prefill.recv()
    assert reply["status"] == "ready" and reply["instance"] == receiver.instance
    done = {"type": "transfer_done", "room": 3, "first_token": 9, "instance": receiver.instance}
    prefill.send({**done, "num_pages": 1})
    ack = prefill.recv()
    assert ack["type"] == "ack" and ack["ok"] is False and "expected" in ack["error"]
    assert router.recv()["status"] == "error"
    router.sync()
    assert receiver.allocator.num_free_pages == 2  # freed after the reply
    prefill.send({**done, "num_pages": 2})
    assert prefill.recv()["ok"] is False  # the room is gone


def test_duplicate_and_oversized_registrations(receiver, router):
    router.register("d1", 4, [1])
    router.register("d2", 4, [1])
    assert router.recv() == {"rid": "d2", "status": "error", "error": "room 4 is in use"}
    router.register("big", 5, [1] * (3 * PAGE))
    assert "pool has 2" in router.recv()["error"]


def test_router_abort_of_a_queued_registration(receiver, router):
    router.register("full", 6, [1] * (2 * PAGE))
    router.register("queued", 7, [1])
    router.send({"type": "abort", "room": 7})
    assert router.recv() == {"rid": "queued", "status": "error", "error": "aborted"}
    router.send({"type": "abort", "room": 6})
    assert router.recv()["rid"] == "full"
    router.sync()
    assert receiver.allocator.num_free_pages == 2


def test_router_abort_waits_for_the_prefill_to_stop(receiver, router, prefill):
    router.register("dr", 8, [1] * PAGE)
    router.sync()
    prefill.send({"type": "bootstrap", "room": 8})
    assert prefill.recv()["status"] == "ready"
    router.send({"type": "abort", "room": 8})
    assert router.recv()["status"] == "error"
    assert prefill.recv() == {"type": "abort", "room": 8}
    router.sync()
    assert receiver.allocator.num_free_pages == 1  # still draining
    prefill.send({"type": "abort", "room": 8})  # the prefill confirms
    prefill.sync()
    assert receiver.allocator.num_free_pages == 2


def test_close_answers_live_rooms():
    rx = DecodeReceiver(DecodeArgs(receiver_port=0, max_total_tokens=2 * PAGE))
    with Router(rx.address) as r:
        r.register("live", 1, [1, 2])
        step(rx, 1000)
        rx.close()
        assert r.recv() == {"rid": "live", "status": "error", "error": "decode shut down"}


def test_a_test_delay_holds_only_the_rooms_it_names():
    rx = DecodeReceiver(DecodeArgs(receiver_port=0), delay=TransferDelay(ms=300, every=2))
    with serving(rx), Router(rx.address) as router, Router(rx.address) as prefill:
        for room in (10, 11):
            router.register(f"d{room}", room, [1] * PAGE)
        router.sync()
        for room in (10, 11):
            prefill.send({"type": "bootstrap", "room": room})
            assert prefill.recv()["status"] == "ready"
        t0 = time.monotonic()
        run = rx.instance
        for room in (10, 11):
            done = {"type": "transfer_done", "room": room, "first_token": 1, "num_pages": 1}
            prefill.send({**done, "instance": run})
        ack = {"type": "ack", "ok": True, "error": None, "instance": run}
        assert prefill.recv() == {**ack, "room": 11}
        assert router.recv()["rid"] == "d11"  # before room 10, which was done first
        assert prefill.recv() == {**ack, "room": 10}
        assert router.recv()["rid"] == "d10"
        assert time.monotonic() - t0 >= 0.3
