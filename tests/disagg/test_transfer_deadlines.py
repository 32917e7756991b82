"""What the transfer thread finds due when, on a clock the test sets (explicit `now`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.decode_links import DecodeLinks
from mpprefill.disagg.transfer_deadlines import TransferDeadlines


def deadlines() -> TransferDeadlines:
    return TransferDeadlines(transfer_timeout=2.5, dead_timeout=5.0, heartbeat_interval=0.5)


def test_a_bootstrap_is_due_at_once_then_a_second_after_it_went_out():
    d = deadlines()
    d.ask_at_once(7)
    assert d.ask_due(7, 0.0)
    d.asked(7, 100.0)
    assert not d.ask_due(7, 100.999)
    assert d.ask_due(7, 101.0)


def test_an_unknown_room_is_asked_again_after_fifty_milliseconds():
    d = deadlines()
    d.ask_soon(7, 100.0)
    assert not d.ask_due(7, 100.049)
    assert d.ask_due(7, 100.05)


def test_a_transferring_sender_is_overdue_only_past_its_deadline():
    waiting = SimpleNamespace(transfer_by=math.inf)  # not Transferring yet
    late = SimpleNamespace(transfer_by=10.0)
    d = deadlines()
    assert d.overdue([waiting, late], 10.0) == []
    assert d.overdue([waiting, late], 10.001) == [late]
    assert d.overdue_reason() == "KV transfer not done within 2.5 s"


def test_a_link_is_pinged_then_dead_then_closed_when_idle():
    d = deadlines()
    assert not d.ping_due(100.0, 100.49) and d.ping_due(100.0, 100.5)
    assert not d.link_silent(100.0, 105.0) and d.link_silent(100.0, 105.01)
    assert not d.link_idle_over(100.0, 130.0) and d.link_idle_over(100.0, 130.01)


def test_links_tend_pings_a_busy_link_reports_a_silent_one_and_closes_an_idle_one():
    ctx = zmq.Context()
    decode = ctx.socket(zmq.ROUTER)
    port = decode.bind_to_random_port("tcp://127.0.0.1")
    links = DecodeLinks(ctx, zmq.Poller(), deadlines(), fixed=None)
    try:
        links.bind(1, f"127.0.0.1:{port}")
        busy = links.of(1)
        busy.last_heard = busy.last_ping = 1000.0
        assert links.tend(1000.6) == []  # pinged
        assert decode.poll(5000)
        assert isinstance(wire.decode(decode.recv_multipart()[1]), wire.Ping)
        assert links.tend(1005.1) == [busy]  # silent past the dead timeout
        assert links.unbind(1) is busy and not busy.rooms
        busy.idle_since = 1000.0
        assert links.tend(1029.0) == [] and links.readable({busy.sock: zmq.POLLIN}) == [busy]
        links.tend(1030.1)  # idle past LINK_IDLE_S: closed
        assert links.readable({busy.sock: zmq.POLLIN}) == []
    finally:
        links.close()
        decode.close(linger=0)
        ctx.term()


def test_the_fixed_decode_link_stays_open_when_idle():
    ctx = zmq.Context()
    links = DecodeLinks(ctx, zmq.Poller(), deadlines(), fixed="127.0.0.1:9")
    try:
        link = links.link("127.0.0.1:9")
        link.idle_since = 0.0
        assert links.tend(1e6) == []
        assert links.readable({link.sock: zmq.POLLIN}) == [link]
    finally:
        links.close()
        ctx.term()
