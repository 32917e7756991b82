"""The socket front in this process: how much one poll reads, and one reply for every
request read, also when the loop fails."""

from __future__ import annotations

import signal
import time

import pytest

from mpprefill import protocol
from mpprefill.bench.procs import free_port
from mpprefill.config import ServerArgs
from mpprefill.server import server as front_module
from mpprefill.server.client import Client
from mpprefill.server.server import PrefillServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def front():
    """front() -> (a PrefillServer in this process, normal mode, not serving yet, a client)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    started: list[tuple[PrefillServer, Client]] = []

    def start() -> tuple[PrefillServer, Client]:
        args = ServerArgs(
            forward_mode="normal",
            zmq_port=free_port(),
            disable_http_front=True,
            disable_gc_freeze=True,
            log_level="warning",
        )
        srv = PrefillServer(args)
        client = Client(f"127.0.0.1:{args.zmq_port}")
        started.append((srv, client))
        return srv, client

    yield start
    for srv, client in started:
        client.close()
        if not srv.ctx.closed:
            srv.close()
        srv.gc.uninstall()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _arrived(srv: PrefillServer) -> None:
    """Frames sent are on the server's socket (the first one, and a moment for the rest)."""
    assert srv.clients.sock.poll(10_000)
    time.sleep(1.0)


def test_one_poll_reads_a_bounded_number_of_bytes(front):
    """Large frames are parsed a budget at a time, each budget validated before the next."""
    srv, client = front()
    n = 256
    prompt = [1000 + j % 3000 for j in range(11_000)]  # about 64 KiB of JSON
    for i in range(n):
        client.generate(f"big{i}", prompt)
    _arrived(srv)
    smallest = len(protocol.generate_frame("big0", prompt))
    per_poll = front_module.MAX_BYTES_PER_POLL // smallest + 1  # the last one crosses it
    counts = []
    deadline = time.monotonic() + 30
    while sum(counts) < n and time.monotonic() < deadline:
        counts.append(len(srv.scheduler.recv_requests()))
        srv.clients.sock.poll(100)
    assert sum(counts) == n
    assert max(counts) <= per_poll < n, counts


def test_requests_read_but_never_live_are_answered_when_the_loop_fails(front, monkeypatch):
    srv, client = front()
    rids = {f"s{i}" for i in range(8)}
    for rid in sorted(rids):
        client.generate(rid, [1, 2, 3])
    _arrived(srv)
    add_request = srv.scheduler.add_request

    def add_or_fail(req):
        if req.rid == "s3":
            raise RuntimeError("injected failure of ingestion")
        add_request(req)

    monkeypatch.setattr(srv.scheduler, "add_request", add_or_fail)
    assert srv.serve_forever() == 1
    replies = client.recv_until(rids, timeout=10)  # s3 and those behind it never went live
    assert all(replies[f"s{i}"]["error"] == "internal server error" for i in range(3, 8))
    assert client.sock.poll(300) == 0  # and each answered once
