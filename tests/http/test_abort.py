"""Aborts through the HTTP front, before a serve whose decode side never answers (its
requests wait in the bootstrap queue): /abort_request ends a request in flight, and a
client that hangs up has its request aborted at the scheduler."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mpprefill.bench.procs import free_port  # noqa: E402
from tests.http.helpers import Front  # noqa: E402
from tests.reliability.helpers import Serve  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def slow_front():
    """A front before a serve whose decode address nobody answers: a request waits there
    for its bootstrap (up to --bootstrap-timeout) while the scheduler is idle."""
    serve = Serve.start(
        *("--forward-mode", "normal", "--disaggregation-transfer-backend", "shm"),
        *("--decode-address", f"127.0.0.1:{free_port()}", "--bootstrap-timeout", "120"),
        *("--log-level", "warning"),
    )
    front = None
    try:
        front = Front.start(serve.port)
        yield front
    finally:
        if front is not None:
            front.kill()
        serve.kill()


def _counters(front: Front) -> dict:
    status, info = front.get("/server_info")
    assert status == 200
    return info["internal_states"][0]["counters"]


def _wait_in_flight(front: Front, rid: str) -> None:
    """Until the scheduler holds a request waiting for its bootstrap."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, info = front.get("/server_info")
        if status == 200 and info["internal_states"][0]["queues"]["bootstrap"] >= 1:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{rid} never became live")


def test_abort_request_ends_a_request_in_flight(slow_front):
    out: dict = {}

    def generate():
        body = {"input_ids": [1, 2, 3], "rid": "slow-1", "bootstrap_room": 11}
        out["reply"] = slow_front.post("/generate", body)

    thread = threading.Thread(target=generate)
    t0 = time.monotonic()
    thread.start()
    _wait_in_flight(slow_front, "slow-1")
    assert slow_front.post("/abort_request", {"rid": "slow-1"}) == (200, {"rids": ["slow-1"]})
    thread.join(60)
    status, body = out["reply"]
    assert status == 200, body
    assert body["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by client"}
    assert body["output_ids"] == [] and body["meta_info"]["id"] == "slow-1"
    assert time.monotonic() - t0 < 60  # well before the bootstrap timeout


def test_a_client_that_hangs_up_has_its_request_aborted(slow_front):
    failed = _counters(slow_front)["num_failed"]
    body = json.dumps({"input_ids": [4, 5, 6], "rid": "gone-1", "bootstrap_room": 12}).encode()
    with socket.create_connection(("127.0.0.1", slow_front.port), timeout=10) as sock:
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        _wait_in_flight(slow_front, "gone-1")
    deadline = time.monotonic() + 60
    while _counters(slow_front)["num_failed"] == failed and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _counters(slow_front)["num_failed"] == failed + 1
    assert slow_front.post("/abort_request", {"rid": "gone-1"}) == (200, {"rids": []})


def test_flush_cache_is_refused_while_a_request_is_live(slow_front):
    out: dict = {}

    def generate():
        body = {"input_ids": [7, 8, 9], "rid": "slow-flush", "bootstrap_room": 13}
        out["reply"] = slow_front.post("/generate", body)

    thread = threading.Thread(target=generate)
    thread.start()
    _wait_in_flight(slow_front, "slow-flush")
    status, _, text = slow_front.request("POST", "/flush_cache")
    assert status == 400 and b"not flushed" in text, text
    assert slow_front.post("/abort_request", {"rid": "slow-flush"})[0] == 200
    thread.join(60)
    assert out["reply"][0] == 200
    status, _, text = slow_front.request("POST", "/flush_cache")
    assert status == 200, text
