"""The transfer thread's rooms, driven by hand: a ROUTER stands in for the decode receiver,
and `now` is given, so what goes out when is checked message by message."""

from __future__ import annotations

import pytest
import torch
import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.bootstrap_server import BootstrapEndpoint
from mpprefill.disagg.decode_links import DecodeLinks
from mpprefill.disagg.decode_replies import DecodeReplies
from mpprefill.disagg.live_rooms import LiveRooms
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.room_registry import RoomRegistry
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.transfer_deadlines import TransferDeadlines
from mpprefill.disagg.transfer_sender import CommandQueue, TransferSender
from mpprefill.memory.kv_cache import KVCache

PAGE = 4


class Decode:
    """A ROUTER where the links connect, and what arrived on it."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.address = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self, timeout_ms: int = 5000) -> wire.Message:
        assert self.sock.poll(timeout_ms), "nothing arrived"
        return wire.decode(self.sock.recv_multipart()[1])

    def quiet(self) -> bool:
        return not self.sock.poll(100)


@pytest.fixture
def parts():
    ctx = zmq.Context()
    decode = Decode(ctx)
    pages = PageWrites(ShippedKV.of(KVCache(2, 64, 2, 8)), PAGE)
    deadlines = TransferDeadlines(transfer_timeout=2.0, dead_timeout=5.0, heartbeat_interval=0.5)
    endpoint = BootstrapEndpoint(ctx, "127.0.0.1", 0, expiry_s=10.0)
    commands = CommandQueue()
    made = []

    def rooms(fixed: bool) -> LiveRooms:
        links = DecodeLinks(ctx, zmq.Poller(), deadlines, decode.address if fixed else None)
        made.append(links)
        return LiveRooms(links, None if fixed else RoomRegistry(endpoint), deadlines, pages)

    def sender(room: int) -> TransferSender:
        return TransferSender(f"r{room}", room, commands, pages.limits(10.0, 2.0))

    yield decode, rooms, sender, endpoint
    for links in made:
        links.close()
    commands.close()
    endpoint.close()
    decode.sock.close(linger=0)
    ctx.term()


def test_a_room_is_bootstrapped_at_once_then_again_after_a_second(parts):
    decode, rooms, sender, _ = parts
    live = rooms(fixed=True)
    s = sender(7)
    live.start(s)
    assert live.holds(s) and s.registered
    live.tick(100.0)
    assert decode.recv() == wire.Bootstrap(7, 1, [[0, 2]], "float32", "heads", 8)
    live.tick(100.9)
    assert decode.quiet()
    live.tick(101.0)
    assert decode.recv() == wire.Bootstrap(7, 1, [[0, 2]], "float32", "heads", 8)


def test_a_duplicate_room_fails_and_a_failed_room_is_aborted_once(parts):
    decode, rooms, sender, _ = parts
    live = rooms(fixed=True)
    first, again = sender(7), sender(7)
    live.start(first)
    live.start(again)
    assert again.poll() == KVPoll.Failed and again.settled()
    assert again.failure_reason() == "bootstrap room 7 is already in use"
    assert live.holds(first)
    live.fail(first, "client gone")
    assert decode.recv() == wire.Abort(7)
    live.fail(first, "client gone")
    assert decode.quiet() and not live.holds(first) and not live.busy


def test_a_transferring_room_past_its_deadline_fails(parts):
    decode, rooms, sender, _ = parts
    live = rooms(fixed=True)
    s = sender(7)
    live.start(s)
    s.ready(None, torch.arange(2), 0, 0, "run-1")
    s.init(2)
    s.send([0, 1], last=True, first_token=3)  # Transferring, deadline 2 s from now
    live.tick(s.transfer_by)
    assert s.state == KVPoll.Transferring
    live.tick(s.transfer_by + 0.01)
    assert s.failure_reason() == "KV transfer not done within 2.0 s"
    assert wire.Abort(7) in (decode.recv(), decode.recv())  # after the first bootstrap


def test_an_ack_counts_only_from_the_run_that_answered_the_bootstrap(parts):
    decode, rooms, sender, _ = parts
    live = rooms(fixed=True)
    replies = DecodeReplies(live, live.deadlines)
    ok, stranger = sender(7), sender(8)
    for s in (ok, stranger):
        live.start(s)
        s.ready(None, torch.arange(1), 0, 0, "run-1")
        s.init(1)
        s.send([0], last=True, first_token=3)
        s.awaiting_ack = True
    link = live.links.of(7)
    assert replies.on_frame(link, wire.encode(wire.Ack(8, True, instance="run-2"))) is None
    assert stranger.failure_reason() == "ack from another decode run (instance 'run-2')"
    replies.on_frame(link, wire.encode(wire.Ack(7, True, instance="run-1")))
    assert ok.poll() == KVPoll.Success and ok.settled()


def test_a_ready_bootstrap_reply_comes_back_to_the_backend(parts):
    _, rooms, sender, _ = parts
    live = rooms(fixed=True)
    replies = DecodeReplies(live, live.deadlines)
    s = sender(7)
    live.start(s)
    link = live.links.of(7)
    reply = wire.BootstrapReply(7, "ready", {"kind": "shm"}, [0], 0, instance="run-1")
    assert replies.on_frame(link, wire.encode(reply)) == (s, reply)
    unknown = wire.BootstrapReply(7, "unknown")
    assert replies.on_frame(link, wire.encode(unknown)) is None
    assert not live.deadlines.ask_due(7, 0.0)  # asked again soon, not at once


def test_an_unbound_sender_that_fails_refuses_its_late_registrant(parts):
    _, rooms, sender, endpoint = parts
    live = rooms(fixed=False)
    s = sender(7)
    live.start(s)
    assert live.links.of(7) is None and live.busy
    s.abort("aborted by the client")  # the scheduler's abort, then its command on the thread
    live.fail(s, s.failure_reason())
    why, code, _ = endpoint.refused_rooms[7]
    assert why == "the prefill refused the request: aborted by the client" and code is None


def test_a_waiting_registration_binds_its_room_on_start(parts):
    decode, rooms, sender, endpoint = parts
    live = rooms(fixed=False)
    assert endpoint.hold(b"reg", wire.RegisterRoom(7, decode.address)) is None
    s = sender(7)
    s.registered = False  # as the backend makes it without a fixed decode address
    live.start(s)
    assert s.registered and live.address_of(7) == decode.address
    live.tick(100.0)
    assert decode.recv() == wire.Bootstrap(7, 1, [[0, 2]], "float32", "heads", 8)
