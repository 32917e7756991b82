"""The prefill's bootstrap endpoint, in-process: rooms go to the decode that registered them,
and hostile registrations are refused while the endpoint keeps serving."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from ipc.codec import MessageError
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.bootstrap_server import BootstrapEndpoint
from mpprefill.disagg.sender import KVPoll
from mpprefill.protocol import Code
from tests.disagg.helpers import PAGE, FakeReq, Router, bootstrap, send_chunks, serving, wait_state

pytestmark = pytest.mark.timeout(60)


class Registrant:
    """A decode server's link to the endpoint: raw frames, bounded waits."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def register(self, room: int, address: str) -> dict:
        self.send({"type": "register_room", "room": room, "address": address})
        return self.recv()

    def send(self, obj) -> None:
        self.sock.send(json.dumps(obj).encode())

    def recv(self, timeout: float = 10.0) -> dict | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return json.loads(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def receivers():
    """Two decode receivers in this process, each on its own thread."""
    rxs = [DecodeReceiver(DecodeArgs(receiver_port=0, page_size=PAGE, verify=True)) for _ in "ab"]
    with serving(rxs[0]), serving(rxs[1]):
        yield rxs


@pytest.fixture
def backend(pool):
    b = make_transfer("shm", pool[0], PAGE, None, bootstrap_port=0, bootstrap_timeout=10.0)
    yield b
    b.close()


def _finish(sender, prompt) -> None:
    bootstrap(sender, prompt)
    send_chunks(sender, prompt, chunk_pages=1)
    assert wait_state(sender, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success, (
        sender.failure_reason()
    )


def test_each_room_goes_to_the_decode_that_registered_it(pool, receivers, backend, room):
    _, prompts = pool
    rooms = [room(), room()]
    reg = Registrant(backend.endpoint.port)
    try:
        with Router(receivers[0].address) as r0, Router(receivers[1].address) as r1:
            for r, rt, p in zip(rooms, (r0, r1), prompts, strict=False):
                rt.register(f"q{r}", r, p.ids)
                rt.sync()
            # room 0 registered before its request reaches the prefill, room 1 after
            assert reg.register(rooms[0], receivers[0].address) == {
                "type": "room_reply",
                "room": rooms[0],
                "ok": True,
                "error": None,
                "code": None,
            }
            s0 = backend.create_sender(FakeReq("q0", rooms[0], len(prompts[0].ids)))
            s1 = backend.create_sender(FakeReq("q1", rooms[1], len(prompts[1].ids)))
            assert s1.poll() == KVPoll.Bootstrapping and not s1.registered
            assert reg.register(rooms[1], receivers[1].address)["ok"] is True
            _finish(s0, prompts[0])
            _finish(s1, prompts[1])
            a, b = r0.recv(), r1.recv()
    finally:
        reg.close()
    assert a["rid"] == f"q{rooms[0]}" and a["status"] == "done" and a["verified"] is True
    assert b["rid"] == f"q{rooms[1]}" and b["status"] == "done" and b["verified"] is True
    assert a["first_token"] == prompts[0].first_token
    assert b["first_token"] == prompts[1].first_token


def test_a_room_nobody_registers_fails_by_the_bootstrap_timeout(pool, room):
    b = make_transfer("shm", pool[0], PAGE, None, bootstrap_port=0, bootstrap_timeout=0.5)
    try:
        r = room()
        s = b.create_sender(FakeReq("lonely", r, 20))
        assert wait_state(s, KVPoll.Failed, timeout=10) == KVPoll.Failed
        assert s.failure_reason() == f"no decode registered room {r} within 0.5 s"
    finally:
        b.close()


def test_hostile_registrations_are_refused_and_the_endpoint_keeps_serving(pool, receivers, room):
    b = make_transfer("shm", pool[0], PAGE, None, bootstrap_port=0, max_waiting_registrations=2)
    x, y, big = (Registrant(b.endpoint.port) for _ in range(3))
    try:
        x.sock.send(b"not json")
        assert x.recv()["type"] == "error"
        r = room()
        for bad in ("nohost", "h:0", "h:70000", "a b:1", "x" * 300 + ":1", 12):
            reply = x.register(r, bad)
            assert reply["ok"] is False and "address" in reply["error"], bad
        x.send({"type": "bootstrap", "room": r})  # a decode's message, not a registration
        assert x.recv()["ok"] is False
        x.sock.send_multipart([b"a", b"b"])
        assert x.recv()["type"] == "error"
        big.send({"type": "register_room", "room": r, "address": "h:1", "pad": "x" * 4096})
        assert big.recv(timeout=1.0) is None  # over MAXMSGSIZE: its link dropped, no reply

        taken = room()
        assert x.register(taken, receivers[0].address)["ok"] is True
        assert x.register(taken, receivers[0].address)["ok"] is True  # a retry is fine
        refused = y.register(taken, receivers[1].address)
        assert refused["ok"] is False and "another decode" in refused["error"]
        y.send({"type": "abort", "room": taken})  # only its registrant withdraws a room
        assert y.recv()["ok"] is False
        assert x.register(room(), "127.0.0.1:1")["ok"] is True  # the second waiting
        full = x.register(room(), "127.0.0.1:1")
        assert full["ok"] is False and "already wait" in full["error"]

        # the registrant withdraws its room: the request that comes later finds none
        x.send({"type": "abort", "room": taken})
        x.sock.send(b"sync")  # answered after the abort was handled
        assert x.recv()["type"] == "error"
        assert y.register(taken, receivers[1].address)["ok"] is True  # free again
        with Router(receivers[1].address) as rt:
            prompt = pool[1][0]
            rt.register("after", taken, prompt.ids)
            rt.sync()
            s = b.create_sender(FakeReq("after", taken, len(prompt.ids)))
            _finish(s, prompt)
            assert rt.recv()["status"] == "done"
    finally:
        for r in (x, y, big):
            r.close()
        b.close()


def test_registrations_expire(pool, receivers, room):
    b = make_transfer("shm", pool[0], PAGE, None, bootstrap_port=0, bootstrap_timeout=0.5)
    reg = Registrant(b.endpoint.port)
    try:
        r = room()
        assert reg.register(r, receivers[0].address)["ok"] is True
        assert reg.recv(timeout=1.0) is None  # past its expiry; nothing is sent meanwhile
        s = b.create_sender(FakeReq("late", r, 20))
        assert wait_state(s, KVPoll.Failed, timeout=10) == KVPoll.Failed
        assert "no decode registered" in s.failure_reason()
    finally:
        reg.close()
        b.close()


def test_a_request_refused_before_its_sender_refuses_its_room(pool, receivers, room):
    """The prefill refused the request (overloaded, bad input) or it failed before any
    decode registered its room: the registrant hears so at once, before or after, with the
    status the prefill replied with when it refused the request."""
    b = make_transfer("shm", pool[0], PAGE, None, bootstrap_port=0, bootstrap_timeout=10.0)
    reg = Registrant(b.endpoint.port)
    address = receivers[0].address
    try:
        before, after, aborted, live = room(), room(), room(), room()
        assert reg.register(before, address)["ok"] is True  # waits for its request
        b.refuse(before, "overloaded", Code.OVERLOADED)
        assert reg.recv() == {
            "type": "room_reply",
            "room": before,
            "ok": False,
            "error": "the prefill refused the request: overloaded",
            "code": 429,
        }
        b.refuse(after, "token id 99999 outside the vocabulary", Code.BAD_REQUEST)
        reply = reg.register(after, address)
        assert reply["ok"] is False and "outside the vocabulary" in reply["error"]
        assert reply["code"] == 400
        s = b.create_sender(FakeReq("gone", aborted, 20))
        s.abort("aborted by client")  # while no decode had registered it
        assert wait_settled(s)
        reply = reg.register(aborted, address)
        assert reply["ok"] is False and "aborted by client" in reply["error"]
        assert reply["code"] is None  # a sender's failure: no status of the prefill's
        kept = b.create_sender(FakeReq("kept", live, 20))
        b.refuse(live, "duplicate rid while the first is live")  # another request's room
        assert reg.register(live, address)["ok"] is True
        kept.abort()
    finally:
        reg.close()
        b.close()


def wait_settled(sender, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not sender.settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    return sender.settled()


def test_bootstrap_endpoint_messages_round_trip():
    msg = wire.RegisterRoom(5, "decode-1.local:30200")
    assert wire.decode(wire.encode(msg)) == msg
    reply = wire.RoomReply(5, False, "why")
    assert wire.decode(wire.encode(reply)) == reply
    overloaded = wire.RoomReply(5, False, "the prefill refused the request: overloaded", 429)
    assert wire.decode(wire.encode(overloaded)).code == 429
    old = {"type": "room_reply", "room": 5, "ok": False, "error": "why"}  # a peer without codes
    assert wire.decode(json.dumps(old).encode()) == wire.RoomReply(5, False, "why", None)
    with pytest.raises(MessageError, match="code"):
        wire.decode(json.dumps({**old, "code": "429"}).encode())
    assert wire.check_address("[::1]:30200") == "[::1]:30200"
    with pytest.raises(ValueError, match="host:port"):
        wire.check_address("127.0.0.1")


def test_remembered_refusals_expire_and_are_capped():
    """A room refused before anyone registered it is remembered for `expiry_s`, at most
    `max_waiting` of them (the oldest forgotten first), and told once."""
    ctx = zmq.Context()
    ep = BootstrapEndpoint(ctx, "127.0.0.1", 0, expiry_s=30.0, max_waiting=2)
    try:
        for room in (1, 2, 3):
            ep.refuse_room(room, f"why {room}", Code.OVERLOADED)
        assert ep.take_refusal(1) is None  # the cap dropped the oldest
        assert ep.take_refusal(2) == ("why 2", Code.OVERLOADED)
        assert ep.take_refusal(2) is None  # told once
        ep.expire(time.monotonic() + 31.0)
        assert ep.take_refusal(3) is None  # past its expiry
    finally:
        ep.close()
        ctx.term()
