"""The bench's router against a ROUTER socket that plays the prefill and the decode: how many
requests it keeps unanswered, and the decode's stamp of its first token."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq

from mpprefill.bench.router import Router
from mpprefill.bench.workload import random_prompts
from mpprefill.disagg import wire

pytestmark = pytest.mark.timeout(30)


class Server:
    """Answers each generate with done, after the request before it is answered; records
    how many requests were unanswered when each arrived."""

    def __init__(self, ctx: zmq.Context, decode: bool = False) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.decode = decode
        self.open_at_arrival: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)

    def _serve(self) -> None:
        waiting: list[tuple[bytes, str]] = []
        while not self._stop.is_set():
            while self.sock.poll(20):  # what the router has sent by now
                ident, frame = self.sock.recv_multipart()
                waiting.append((ident, msgspec.json.decode(frame)["rid"]))
                self.open_at_arrival.append(len(waiting))
            if waiting:
                ident, rid = waiting.pop(0)
                self.sock.send_multipart([ident, self._done(rid)])
        self.sock.close(linger=0)

    def _done(self, rid: str) -> bytes:
        if self.decode:
            return wire.encode(wire.RouterReply(rid, "done", 7, emitted_at=1234.5))
        return msgspec.json.encode({"rid": rid, "status": "done", "first_token": 7})


@pytest.fixture
def servers():
    """servers(decode=False) -> a running Server; all stopped after the test."""
    ctx = zmq.Context()
    made: list[Server] = []

    def make(decode: bool = False) -> Server:
        made.append(Server(ctx, decode))
        return made[-1]

    yield make
    for s in made:
        s.stop()
    ctx.term()


@pytest.mark.parametrize("limit, most_open", [(1, 1), (2, 2), (None, 6)])
def test_at_most_max_concurrency_requests_are_unanswered(servers, limit, most_open):
    prefill = servers()
    router = Router(prefill.port, None)
    try:
        work = random_prompts(6, 8, seed=1)
        results = router.run(work.requests, 1, timeout=20.0, max_concurrency=limit)
    finally:
        router.close()
    assert [r.status for r in results] == ["done"] * 6
    assert max(prefill.open_at_arrival) == most_open
    assert all(r.ttft_decode_s is None for r in results)  # no decode answered


def test_ttft_at_the_decode_is_the_decodes_stamp_less_the_send(servers):
    prefill, decode = servers(), servers(decode=True)
    router = Router(prefill.port, decode.port)
    try:
        [r] = router.run(random_prompts(1, 8).requests, 1, timeout=20.0)
    finally:
        router.close()
    assert r.status == "done" and r.t_decode_emitted == 1234.5
    assert r.ttft_decode_s == pytest.approx(1234.5 - r.t_send)
