"""Signals to `mpprefill serve`: graceful on the first, immediate on a second; clean on both."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.reliability.helpers import pid_gone, runtime_dir_of

pytestmark = pytest.mark.timeout(90)
BUSY = ("--forward-mode", "proc-ahead", "--chunked-prefill-size", "16")


def _flood(client, n: int, tag: str) -> set[str]:
    rids = {f"{tag}{i}" for i in range(n)}
    for i, rid in enumerate(sorted(rids)):  # distinct prompts: no cache hits to speed it up
        client.generate(rid, [(i * 7 + j) % 4000 + 1 for j in range(64)])
    return rids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_answers_everything_and_exits_clean(serve, sig):
    srv = serve(*BUSY, "--max-running-requests", "2", "--max-queued-requests", "100000")
    worker = srv.worker_pid()
    runtime_dir = runtime_dir_of(worker)
    client = srv.client()
    rids = _flood(client, 3000, "p")  # most are still on the socket when the signal lands
    time.sleep(0.3)
    t0 = time.monotonic()
    srv.proc.send_signal(sig)
    assert srv.proc.wait(10) == 0, srv.output()
    assert time.monotonic() - t0 < 5.0
    replies = client.recv_until(rids, timeout=10)
    assert set(replies) == rids  # every request answered, live or queued on the socket
    errors = [r["error"] for r in replies.values() if r["status"] == "error"]
    assert errors and all(e == "server shutting down" for e in errors)
    assert client.sock.poll(300) == 0  # and answered once
    assert srv.segments() == [] and pid_gone(worker)
    assert not os.path.exists(runtime_dir)  # the ipc:// socket dir went with it
    client.close()


def test_second_signal_exits_at_once_and_still_unlinks(serve):
    srv = serve(
        *("--forward-mode", "proc-ahead", "--worker-threads", "1"),
        *("--chunked-prefill-size", "8192", "--max-prefill-tokens", "8192"),
    )
    worker, client = srv.worker_pid(), srv.client()
    runtime_dir = runtime_dir_of(worker)
    assert srv.segments()
    client.generate("long", [(j * 13) % 4000 + 1 for j in range(8000)])  # a forward of seconds
    time.sleep(0.8)
    srv.proc.send_signal(signal.SIGTERM)  # graceful: waits for the forward in flight
    time.sleep(0.2)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(10) == 128 + signal.SIGINT, srv.output()
    assert time.monotonic() - t0 < 1.5
    assert pid_gone(worker, 2.0)  # killed, not waited for
    assert srv.segments() == []  # the scheduler's and the forward process's
    assert not os.path.exists(runtime_dir)
    client.close()


def test_forward_process_dies_with_a_killed_scheduler_mid_forward(serve):
    srv = serve(
        *("--forward-mode", "proc-ahead", "--worker-threads", "1"),
        *("--chunked-prefill-size", "8192", "--max-prefill-tokens", "8192"),
    )
    worker, client = srv.worker_pid(), srv.client()
    client.generate("long", [(j * 13) % 4000 + 1 for j in range(8000)])  # a forward of seconds
    time.sleep(0.8)
    srv.proc.kill()
    assert pid_gone(worker, 1.5)  # at once, not after its forward
    assert not [s for s in srv.segments() if f".{worker}." in s]  # it unlinked its own
    client.close()
