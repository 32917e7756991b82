"""A forward process that dies is noticed by the front at once, whether or not a forward is
in flight: every live request answered, exit status 1, every segment removed."""

from __future__ import annotations

import os
import signal

import pytest

from mpprefill.bench.procs import free_port
from tests.reliability.helpers import pid_gone, wait_live

pytestmark = pytest.mark.timeout(120)
NOTICED_S = 10.0  # a generous bound: the front polls the worker's sentinel


@pytest.mark.parametrize("mode", ["proc", "proc-ahead"])
def test_an_idle_server_notices_its_worker_die(serve, mode):
    srv = serve("--forward-mode", mode, "--disaggregation-transfer-backend", "fake")
    worker = srv.worker_pid()
    os.kill(worker, signal.SIGKILL)
    assert srv.proc.wait(NOTICED_S) == 1, srv.output()  # no request needed to notice
    assert "forward worker failed" in srv.output()
    assert pid_gone(worker) and srv.segments() == []


def test_a_request_waiting_for_its_decode_side_gets_the_worker_failure(serve):
    srv = serve(
        *("--forward-mode", "proc-ahead", "--disaggregation-transfer-backend", "shm"),
        *("--decode-address", f"127.0.0.1:{free_port()}", "--bootstrap-timeout", "60"),
    )
    client = srv.client()
    client.generate("waiting", [1, 2, 3], bootstrap_room=5)  # no decode side: it waits
    assert wait_live(client, 1)["queues"]["live"] == 1
    os.kill(srv.worker_pid(), signal.SIGKILL)
    reply = client.recv(NOTICED_S)
    assert reply["rid"] == "waiting" and reply["status"] == "error"
    assert reply["error"].startswith("worker failure"), reply
    assert srv.proc.wait(NOTICED_S) == 1, srv.output()
    assert srv.segments() == []
    client.close()
