"""A forward process that is alive but never answers: --forward-timeout fails its requests
and the server treats the worker as dead."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tests.reliability.helpers import pid_gone

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mode", ["proc", "proc-ahead"])
def test_a_hung_worker_fails_the_batch_and_the_server_exits(serve, mode):
    srv = serve("--forward-mode", mode, "--forward-timeout", "2")
    worker, client = srv.worker_pid(), srv.client()
    client.generate("warm", [1, 2, 3])
    assert client.recv_until({"warm"}, timeout=30)["warm"]["status"] == "done"
    os.kill(worker, signal.SIGSTOP)
    try:
        client.generate("stuck", [4, 5, 6])
        reply = client.recv_until({"stuck"}, timeout=30)["stuck"]
        assert reply["status"] == "error" and "stalled" in reply["error"], reply
        assert srv.proc.wait(30) == 1, srv.output()
        assert pid_gone(worker, 10)  # killed: a stopped process takes SIGKILL too
        assert srv.segments() == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    client.close()
