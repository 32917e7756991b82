"""The request socket both servers serve: parsed requests out, bad frames answered here."""

from __future__ import annotations

import json
import time

import pytest
import zmq

import mpprefill.protocol as protocol
from mpprefill.request_socket import RequestSocket


@pytest.fixture
def pair():
    ctx = zmq.Context()
    server = RequestSocket(ctx, "127.0.0.1", 0)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"tcp://127.0.0.1:{server.port}")
    yield server, client
    client.close()
    server.close(linger_ms=0)
    ctx.term()


def _read_all(server: RequestSocket, expect: int, max_frames: int = 64) -> list:
    got: list = []
    for _ in range(200):
        if server.sock.poll(50):
            got += server.read(max_frames)[1]
        if len(got) >= expect:
            break
    return got


def _reply(client: zmq.Socket) -> dict:
    assert client.poll(5000), "no reply"
    return json.loads(client.recv())


def test_a_request_comes_out_parsed_with_its_client(pair):
    server, client = pair
    client.send(protocol.generate_frame("r1", [1, 2, 3], bootstrap_room=7))
    ((ident, msg),) = _read_all(server, 1)
    assert isinstance(msg, protocol.Generate)
    assert (msg.rid, msg.input_ids, msg.bootstrap_room) == ("r1", [1, 2, 3], 7)
    server.send(ident, protocol.error_reply("r1", "why", protocol.Code.OVERLOADED))
    assert _reply(client) == {"status": "error", "rid": "r1", "error": "why", "code": 429}


def test_bad_frames_are_answered_here_to_their_rid_and_counted(pair):
    server, client = pair
    client.send_multipart([protocol.abort_frame("two"), b"{}"])  # two frames in one message
    client.send(b'{"type": "generate", "rid": "r2", "input_ids": "x"}')
    client.send(b"not json")
    got = []
    for _ in range(100):  # until the three replies are out
        if server.sock.poll(50):
            got += server.read(64)[1]
        if server.bad_frames == 3:
            break
    assert got == []
    replies = [_reply(client) for _ in range(3)]
    assert [r.get("rid") for r in replies] == ["two", "r2", None]
    assert all(r["status"] == "error" and r["code"] == 400 for r in replies)
    assert "2 frames, one expected" in replies[0]["error"]
    assert "input_ids" in replies[1]["error"]
    assert server.counters() == {"replies_dropped": 0, "bad_frames": 3}


def test_one_read_takes_at_most_its_frames(pair):
    """Reads of at most 2 take 5 queued frames in order, never more than 2 at once. NOTE: a
    read takes what has arrived, so the frames are given time to arrive first, and a read
    of 1 (a frame still on its way) is allowed as long as some read takes 2."""
    server, client = pair
    for i in range(5):
        client.send(protocol.abort_frame(f"a{i}"))
    assert server.sock.poll(5000)
    time.sleep(0.2)
    sizes, got = [], []
    for _ in range(100):
        n, frames = server.read(max_frames=2)
        if n:
            sizes.append(n)
            got += frames
        if len(got) >= 5:
            break
        server.sock.poll(50)
    assert sizes and max(sizes) == 2, sizes  # no read took more than 2, and one took 2
    assert [m.rid for _, m in got] == [f"a{i}" for i in range(5)]


def test_a_reply_to_a_gone_client_is_dropped_and_counted(pair):
    server, _ = pair
    server.send(b"\x00no-such-client", protocol.error_reply("r", "x"))
    assert server.counters() == {"replies_dropped": 1, "bad_frames": 0}
