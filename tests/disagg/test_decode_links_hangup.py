"""A decode's link to a prefill endpoint refuses the rooms still waiting there when the
prefill hangs up (its process died), and only those: a room whose KV came is not touched."""

from __future__ import annotations

import time

import pytest
import zmq

from mpprefill.decode.prefill_links import HUNG_UP, PrefillLinks
from mpprefill.disagg import wire

pytestmark = pytest.mark.timeout(30)


def _read_until(links: PrefillLinks, poller: zmq.Poller, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = links.read(dict(poller.poll(100)))
        if out:
            return out
    return []


def test_rooms_waiting_on_a_prefill_that_hung_up_are_refused():
    ctx = zmq.Context()
    poller = zmq.Poller()
    endpoint_sock = ctx.socket(zmq.ROUTER)  # the prefill's bootstrap endpoint
    port = endpoint_sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"127.0.0.1:{port}"
    links = PrefillLinks(ctx, poller, "127.0.0.1:1")
    try:
        for room in (7, 8, 9):
            assert links.register(endpoint, room) is None
        got = [wire.decode(endpoint_sock.recv_multipart()[1]) for _ in range(3)]
        assert [m.room for m in got] == [7, 8, 9]  # the link is up: the endpoint heard all
        links.done(endpoint, 8)  # its KV came
        assert links.read(dict(poller.poll(200))) == []  # nothing while the prefill is up
        endpoint_sock.close(linger=0)  # the prefill process ends: its connections close
        replies = _read_until(links, poller)
        assert sorted((e, r.room, r.ok, r.error) for e, r in replies) == [
            (endpoint, 7, False, HUNG_UP),
            (endpoint, 9, False, HUNG_UP),
        ]
    finally:
        links.close()
        ctx.term()
