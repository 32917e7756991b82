"""Happy paths of the shm backend against a decode receiver in a subprocess."""

from __future__ import annotations

import time

import pytest
import torch

from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.shm_backend import plane_view
from tests.disagg.helpers import PAGE, FakeReq, bootstrap, send_chunks, wait_state

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_prefill_segments")]


@pytest.fixture
def backend(pool, decode):
    kv, _ = pool
    b = make_transfer("shm", kv, PAGE, decode.address, bootstrap_timeout=10.0)
    yield b
    b.close()


def test_prompts_arrive_verified_and_byte_equal(pool, backend, router, room):
    kv, prompts = pool
    rooms = [room() for _ in prompts]
    for i, (p, r) in enumerate(zip(prompts, rooms)):
        router.register(f"r{i}", r, p.ids)
    senders = [
        backend.create_sender(FakeReq(f"r{i}", r, len(p.ids)))
        for i, (p, r) in enumerate(zip(prompts, rooms))
    ]
    for s, p in zip(senders, prompts):
        bootstrap(s, p)
        assert len(s.dst_pages) == p.num_pages
    for chunk, (s, p) in enumerate(zip(senders, prompts)):
        send_chunks(s, p, chunk_pages=1 + chunk % 2)
        assert s.poll() in (KVPoll.Transferring, KVPoll.Success)
    for s in senders:
        assert wait_state(s, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, s.failure_reason()
    replies = router.recv_many(len(prompts))
    for i, p in enumerate(prompts):
        reply = replies[f"r{i}"]
        assert reply["status"] == "done", reply
        assert reply["first_token"] == p.first_token
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
    src = plane_view(kv.buffer, PAGE)
    for s, p in zip(senders, prompts):
        assert s.pages_sent == p.num_pages
        # the sender's target: the decode pool as the backend mapped it, in planes
        assert torch.equal(s.target[:, s.dst_pages], src[:, p.pages])


def test_page_rounding_33_tokens_is_3_pages(pool, backend, router, room):
    _, prompts = pool
    p = prompts[0]
    assert len(p.ids) == 33 and p.num_pages == 3
    r = room()
    router.register("round", r, p.ids)
    s = backend.create_sender(FakeReq("round", r, 33))
    bootstrap(s, p)
    assert len(s.dst_pages) == 3 and s.num_pages == 3
    send_chunks(s, p, chunk_pages=2)
    assert wait_state(s, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert s.pages_sent == 3
    assert router.recv()["status"] == "done"


def test_bootstrap_waits_for_registration(pool, backend, router, room):
    _, prompts = pool
    p, r = prompts[1], room()
    s = backend.create_sender(FakeReq("late", r, len(p.ids)))
    time.sleep(0.5)
    assert s.poll() == KVPoll.Bootstrapping
    with pytest.raises(RuntimeError):
        s.send(p.pages, last=True, first_token=1)
    router.register("late", r, p.ids)
    bootstrap(s, p)
    send_chunks(s, p)
    assert wait_state(s, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert router.recv()["status"] == "done"


def test_unregistered_room_times_out(pool, decode, room):
    kv, _ = pool
    b = make_transfer("shm", kv, PAGE, decode.address, bootstrap_timeout=1.0)
    try:
        s = b.create_sender(FakeReq("never", room(), 20))
        t0 = time.monotonic()
        assert wait_state(s, (KVPoll.Failed,), timeout=5) == KVPoll.Failed
        assert 0.9 < time.monotonic() - t0 < 4
        assert "timed out" in s.failure_reason()
    finally:
        b.close()


def test_send_checks_page_counts(pool, backend, router, room):
    _, prompts = pool
    p, r = prompts[2], room()
    router.register("count", r, p.ids)
    s = backend.create_sender(FakeReq("count", r, len(p.ids)))
    bootstrap(s, p)
    with pytest.raises(ValueError):
        s.send(p.pages[:1], last=True, first_token=3)  # pages missing
    with pytest.raises(ValueError):
        s.send(torch.cat([p.pages, p.pages]), last=False)  # too many
    send_chunks(s, p)
    with pytest.raises(RuntimeError):
        s.send(p.pages[:1], last=False)  # after the last send
    assert wait_state(s, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert router.recv()["status"] == "done"
