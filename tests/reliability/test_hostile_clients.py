"""Hostile clients: huge rids."""

from __future__ import annotations

import json

import pytest

from mpprefill.bench.procs import free_port
from mpprefill.server import protocol
from tests.reliability.helpers import Serve, dealer, recv_json

pytestmark = pytest.mark.timeout(120)
HUGE_RID = "h" + "x" * (3 << 20)  # a 3 MB rid
SMALL_REPLY = 4096  # bytes; a reply with a cut rid and reason stays well under this


@pytest.fixture(scope="module")
def server():
    """No decode side listens: a generate with a room stays bootstrapping for seconds."""
    srv = Serve.start(
        *("--forward-mode", "proc-ahead", "--disaggregation-transfer-backend", "shm"),
        *("--decode-address", f"127.0.0.1:{free_port()}", "--bootstrap-timeout", "60"),
    )
    yield srv
    srv.kill()


def _raw_reply(sock, timeout: float = 30.0) -> bytes:
    assert sock.poll(int(timeout * 1000)), "no reply"
    return sock.recv()


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "abort", "rid": HUGE_RID},
        {"type": "generate", "rid": HUGE_RID, "input_ids": [1, 2], "bad_field": 1},
        {"type": "generate", "rid": HUGE_RID, "input_ids": "not a list"},
    ],
    ids=["abort", "generate-bad-field", "generate-bad-ids"],
)
def test_an_error_reply_echoes_at_most_the_rid_limit(server, frame):
    sock = dealer(server.port)
    sock.send(json.dumps(frame).encode())
    raw = _raw_reply(sock)
    reply = json.loads(raw)
    assert reply["status"] == "error"
    assert reply["rid"] == HUGE_RID[: protocol.MAX_RID_CHARS]
    assert len(raw) < SMALL_REPLY
    sock.close(linger=0)


def test_an_oversize_frame_echoes_at_most_the_rid_limit(server):
    rid = "o" * 500  # the head sniffer reads rids of up to 512 characters
    head = b'{"type": "generate", "rid": "' + rid.encode() + b'", "input_ids": ['
    frame = head + b"1," * (protocol.MAX_FRAME_BYTES // 2) + b"1]}"
    sock = dealer(server.port)
    sock.send(frame)
    raw = _raw_reply(sock)
    assert json.loads(raw)["rid"] == rid[: protocol.MAX_RID_CHARS]
    assert len(raw) < SMALL_REPLY
    sock.close(linger=0)

