"""Hostile clients: huge rids, frames of many MiB, aborts of another client's request."""

from __future__ import annotations

import json

import pytest

from mpprefill import protocol
from mpprefill.bench.procs import free_port
from tests.reliability.helpers import Serve, dealer, recv_json, wait_live

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


@pytest.mark.parametrize("size", [15 << 20, 64 << 20], ids=["15MB", "64MiB"])
def test_a_frame_of_many_mib_gets_a_clear_error(server, size):
    """A 5M-token prompt is some 15 MB of JSON; up to the wire limit it gets an answer."""
    head = b'{"type": "generate", "rid": "many-mib", "input_ids": ['
    frame = head + b"1," * ((size - len(head) - 3) // 2) + b"1]}"
    frame += b" " * (size - len(frame))
    assert len(frame) == size
    sock = dealer(server.port)
    sock.send(frame)
    reply = recv_json(sock, 30)
    assert reply is not None, "the frame was dropped without a reply"
    assert reply["rid"] == "many-mib" and reply["status"] == "error"
    assert f"frame of {size} bytes exceeds" in reply["error"]
    sock.close(linger=0)
    client = server.client()
    assert client.stats()["status"] == "stats"  # and the server goes on
    client.close()


def test_only_the_owner_may_abort_a_request(server):
    owner, other = server.client(), server.client()
    owner.generate("owned", [1, 2, 3], bootstrap_room=11)  # waits for its decode side
    assert wait_live(owner, 1)["queues"]["live"] == 1
    other.abort("owned")
    unknown = {"rid": "owned", "status": "error", "error": "unknown rid", "code": 404}
    assert other.recv(10) == unknown
    assert owner.stats()["queues"]["live"] == 1  # still waiting, not aborted
    owner.abort("owned")
    aborted = {"rid": "owned", "status": "error", "error": "aborted by client", "code": 499}
    assert owner.recv(10) == aborted
    owner.close()
    other.close()
