"""The prefill's transfer backend against a hostile peer at the decode address: bad replies
fail their room only, foreign segments are never written, acks count only from the
receiver run that answered the bootstrap, and every wait and message is bounded."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import zmq

import ipc
from ipc.shm import SHM_DIR
from mpprefill.bench.procs import free_port
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.mooncake_backend import MooncakeUnavailable, check_session
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.shm_backend import ShmPool, kv_shape
from tests.disagg.helpers import PAGE, FakeReq, bootstrap, send_chunks, wait_state

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_prefill_segments")]


class FakeDecode:
    """A ROUTER at the decode address, driven by the test; it answers pings itself."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.address = f"127.0.0.1:{self.port}"

    def expect(self, kind: str, room: int | None = None, timeout: float = 10.0):
        """(peer identity, message) of the next `kind` message (for `room`)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(max(1, int(left * 1000))):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = json.loads(frame)
            if msg["type"] == "ping":
                self.send(ident, {"type": "pong"})
            elif msg["type"] == kind and room in (None, msg.get("room")):
                return ident, msg
        raise TimeoutError(f"no {kind} for room {room}")

    def send(self, ident: bytes, obj) -> None:
        self.send_raw(ident, json.dumps(obj).encode())

    def send_raw(self, ident: bytes, frame: bytes) -> None:
        self.sock.send_multipart([ident, frame])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _ready(room: int, pool: dict, pages: int = 4, instance: str = "run-a") -> dict:
    return {
        "type": "bootstrap_reply",
        "room": room,
        "status": "ready",
        "pool": pool,
        "dst_pages": list(range(pages)),
        "decode_prefix_len": 0,
        "instance": instance,
    }


@pytest.fixture
def peer():
    p = FakeDecode()
    yield p
    p.close()


@pytest.fixture
def decode_pool(pool):
    """A real decode pool (its segment named as a receiver names it) for the good replies."""
    kv = pool[0]
    p = ShmPool(wire.PoolLayout.of(kv.buffer, PAGE, kv.num_layers), kv.dtype)
    yield p
    p.close()


@pytest.fixture
def backend(pool, peer):
    b = make_transfer("shm", pool[0], PAGE, peer.address)
    yield b
    b.close()


def _answer(backend, peer, room: int, reply: dict | bytes):
    """A sender for `room` whose bootstrap gets `reply`."""
    s = backend.create_sender(FakeReq(f"r{room}", room, 20))
    ident, _ = peer.expect("bootstrap", room)
    if isinstance(reply, bytes):
        peer.send_raw(ident, reply)
    else:
        peer.send(ident, reply)
    return s, ident


def _bad_reply(kind: str, desc: dict, room: int) -> dict | bytes:
    handle = desc["handle"]
    no_shape = {k: v for k, v in handle.items() if k != "shape"}
    missing = {**handle, "name": "/mppdecode_999999999_abcdef.999999999.0"}
    replies = {
        "handle-without-shape": lambda: _ready(room, {**desc, "handle": no_shape}),
        "handle-a-list": lambda: _ready(room, {**desc, "handle": [1, 2]}),
        "shape-of-lists": lambda: _ready(room, {**desc, "handle": {**handle, "shape": [[1]]}}),
        "no-such-segment": lambda: _ready(room, {**desc, "handle": missing}),
        "layout-a-number": lambda: _ready(room, {**desc, "layout": 5}),
        "no-instance": lambda: {**_ready(room, desc), "instance": ""},
        "page-beyond-int64": lambda: json.dumps({**_ready(room, desc), "dst_pages": [2**63]}),
    }
    reply = replies[kind]()
    return reply.encode() if isinstance(reply, str) else reply


BAD_REPLIES = [
    "handle-without-shape",
    "handle-a-list",
    "shape-of-lists",
    "no-such-segment",
    "layout-a-number",
    "no-instance",
    "page-beyond-int64",
]


@pytest.mark.parametrize("kind", BAD_REPLIES)
def test_a_bad_bootstrap_reply_fails_its_room_only(kind, backend, peer, decode_pool):
    desc = decode_pool.describe()
    s, _ = _answer(backend, peer, 100, _bad_reply(kind, desc, 100))
    assert wait_state(s, KVPoll.Failed, timeout=5) == KVPoll.Failed
    assert s.target is None
    good, _ = _answer(backend, peer, 101, _ready(101, desc))  # the next room still works
    assert wait_state(good, KVPoll.WaitingForInput) == KVPoll.WaitingForInput


def _segments_to_refuse(layout: wire.PoolLayout, dtype: torch.dtype, stack):
    """(kind, handle dict, tensor that must stay untouched) of segments a fake peer may name."""
    own = stack(ipc.SharedTensor.create(kv_shape(layout), dtype, ipc.new_prefix("mpp")))
    twice = wire.PoolLayout(**{**layout.to_dict(), "num_slots": 2 * layout.num_slots})
    big = stack(ShmPool(twice, dtype))
    half = big.shared.tensor.numel() * big.shared.tensor.element_size() // 2
    shape = list(kv_shape(layout))
    link = f"{big.shared.handle.name.rsplit('.', 1)[0]}.77"
    os.symlink(os.path.join(SHM_DIR, own.handle.name[1:]), os.path.join(SHM_DIR, link[1:]))
    stack(link)
    big_handle = big.shared.handle.to_dict()
    return [
        ("the prefill's own pool", own.handle.to_dict(), own.tensor),
        ("inside a decode pool", {**big_handle, "shape": shape, "offset": half}, big.kv.buffer),
        ("part of a decode pool", {**big_handle, "shape": shape, "nbytes": half}, big.kv.buffer),
        ("a link to the own pool", {**own.handle.to_dict(), "name": link}, own.tensor),
    ]


FOREIGN = ["the prefill's own pool", "inside a decode pool", "part of a decode pool",
           "a link to the own pool"]  # fmt: skip


@pytest.mark.parametrize("case", FOREIGN)
def test_only_a_whole_decode_pool_segment_is_written(case, pool, backend, peer, decode_pool):
    kv, prompts = pool
    layout = wire.PoolLayout.of(kv.buffer, PAGE, kv.num_layers)
    opened = []
    try:
        cases = _segments_to_refuse(layout, kv.dtype, lambda x: opened.append(x) or x)
        kind, handle, tensor = next(c for c in cases if c[0] == case)
        room, p = 300, prompts[0]
        desc = decode_pool.describe()
        s, _ = _answer(backend, peer, room, _ready(room, {**desc, "handle": handle}, 8))
        state = wait_state(s, (KVPoll.Failed, KVPoll.WaitingForInput), timeout=5)
        if state == KVPoll.WaitingForInput:  # it would write there: show that it does
            bootstrap(s, p)
            send_chunks(s, p)
            peer.expect("transfer_done", room)
        assert not tensor.any()
        assert state == KVPoll.Failed and "decode" in s.failure_reason()
    finally:
        for x in opened:
            if isinstance(x, str):
                os.unlink(os.path.join(SHM_DIR, x[1:]))
            else:
                x.close()
                if isinstance(x, ipc.SharedTensor):
                    x.unlink()


def test_mooncake_refuses_its_own_session(pool, peer):
    """A peer naming the prefill's own engine and KV pool as the decode's is refused."""
    try:
        b = make_transfer("mooncake", pool[0], PAGE, peer.address)
    except MooncakeUnavailable as e:
        pytest.skip(f"mooncake transfer engine unavailable: {e}")
    try:
        kv = pool[0]
        layout = wire.PoolLayout.of(kv.buffer, PAGE, kv.num_layers)
        own = {"kind": "mooncake", "layout": layout.to_dict(), "session_id": b.session_id,
               "base": kv.buffer.data_ptr()}  # fmt: skip
        s, _ = _answer(b, peer, 700, _ready(700, own))
        assert wait_state(s, (KVPoll.Failed, KVPoll.WaitingForInput)) == KVPoll.Failed
        assert "not a decode receiver's" in s.failure_reason()
    finally:
        b.close()


def test_mooncake_writes_only_to_a_session_on_the_decode_host():
    check_session("127.0.0.1:15000", "127.0.0.1", own_session="127.0.0.1:16000")
    check_session("127.0.0.1:15000", "localhost", own_session="127.0.0.1:16000")
    for session in ("127.0.0.1:16000", "10.1.2.3:15000", "127.0.0.1", "127.0.0.1:x"):
        with pytest.raises(ValueError):
            check_session(session, "127.0.0.1", own_session="127.0.0.1:16000")


def test_an_ack_counts_only_from_the_run_that_answered_the_bootstrap(
    pool, backend, peer, decode_pool
):
    _, prompts = pool
    p = prompts[0]
    desc = decode_pool.describe()
    early, ident = _answer(backend, peer, 400, _ready(400, desc, p.num_pages))
    bootstrap(early, p)
    peer.send(ident, {"type": "ack", "room": 400, "ok": True, "instance": "run-a"})
    assert wait_state(early, (KVPoll.Failed, KVPoll.Success)) == KVPoll.Failed  # nothing sent

    s, ident = _answer(backend, peer, 401, _ready(401, desc, p.num_pages))
    bootstrap(s, p)
    send_chunks(s, p)
    _, done = peer.expect("transfer_done", 401)
    assert done["instance"] == "run-a" and done["num_pages"] == p.num_pages
    peer.send(ident, {"type": "ack", "room": 401, "ok": True, "instance": "run-b"})
    assert wait_state(s, (KVPoll.Failed, KVPoll.Success)) == KVPoll.Failed
    assert "another decode run" in s.failure_reason()

    s, ident = _answer(backend, peer, 402, _ready(402, desc, p.num_pages))
    bootstrap(s, p)
    send_chunks(s, p)
    peer.expect("transfer_done", 402)
    peer.send(ident, {"type": "ack", "room": 402, "ok": True, "instance": "run-a"})
    assert wait_state(s, (KVPoll.Failed, KVPoll.Success)) == KVPoll.Success


def test_transferring_has_its_own_deadline(pool, peer, decode_pool):
    """The scheduler keeps sending (or stops); the backend fails the room past the deadline
    whatever the peer does, without waiting for a poll's answer timeout."""
    _, prompts = pool
    p = prompts[2]  # 3 pages
    b = make_transfer("shm", pool[0], PAGE, peer.address, transfer_timeout=0.5)
    try:
        s, _ = _answer(b, peer, 500, _ready(500, decode_pool.describe(), p.num_pages))
        bootstrap(s, p)
        s.send(p.pages[:1], last=False)
        t0 = time.monotonic()
        assert wait_state(s, (KVPoll.Failed,), timeout=5) == KVPoll.Failed
        assert time.monotonic() - t0 >= 0.4
        assert "not done within 0.5 s" in s.failure_reason()
        peer.expect("abort", 500)
    finally:
        b.close()


def test_replies_are_bounded(pool, peer, decode_pool):
    b = make_transfer("shm", pool[0], PAGE, peer.address, dead_timeout=1.0)
    try:
        huge = {"type": "bootstrap_reply", "room": 600, "status": "error", "error": "x" * 2000}
        s, ident = _answer(b, peer, 600, huge)
        assert wait_state(s, KVPoll.Failed) == KVPoll.Failed
        assert len(s.failure_reason()) < 400
        s, ident = _answer(b, peer, 601, b"")  # a frame the peer reads no room from
        oversize = {**huge, "room": 601, "error": "x" * wire.MAX_FRAME_BYTES}
        peer.send(ident, oversize)  # ZeroMQ drops the link instead of handing it on
        assert wait_state(s, KVPoll.Failed) == KVPoll.Failed
        assert "silent" in s.failure_reason()  # ... and the backend makes a new one
        s, _ = _answer(b, peer, 602, _ready(602, decode_pool.describe()))
        assert wait_state(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    finally:
        b.close()
