"""The scheduler and its transfer backend's thread: a dead transfer thread stops the loop."""

from __future__ import annotations

import threading
import time

import pytest

from mpprefill.config import ServerArgs
from mpprefill.disagg.decode.args import DecodeArgs
from mpprefill.disagg.decode.receiver import DecodeReceiver
from mpprefill.disagg.sender import TransferDied
from mpprefill.disagg.shm_backend import ShmTransfer
from mpprefill.scheduling.loops import event_loop_normal
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE, serving

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_prefill_segments")]


class GateFence:
    """A KV write fence that holds the transfer thread before its copy until opened."""

    def __init__(self):
        self.reached = threading.Event()
        self.open = threading.Event()

    def required(self, pages) -> int:
        return 1

    def wait(self, gen: int) -> None:
        self.reached.set()
        assert self.open.wait(20)


def _args(address: str) -> ServerArgs:
    return ServerArgs(
        forward_mode="normal",
        page_size=PAGE,
        max_total_tokens=1024,
        disaggregation_transfer_backend="shm",
        decode_address=address,
        worker_threads=1,
    )


def _run_until(s: Scheduler, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    event_loop_normal(s, lambda: done() or time.monotonic() > deadline)
    assert done(), "timed out"


class DyingTransfer(ShmTransfer):
    """A backend whose thread fails on its first tick (a bug, not a peer's doing)."""

    def _tick(self, now: float) -> None:
        raise RuntimeError("boom")


def test_a_dead_transfer_thread_stops_the_scheduler():
    rx = DecodeReceiver(DecodeArgs(port=0, max_total_tokens=1024))
    args = _args(rx.address)
    worker, config = make_worker(args, "normal")
    transfer = DyingTransfer(worker.kv_cache, PAGE, rx.address)
    with serving(rx):
        try:
            deadline = time.monotonic() + 10
            while transfer.death is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "RuntimeError: boom" in transfer.death
            s = Scheduler(args, config, worker, transfer)
            req = Req("d", [1, 2, 3], bootstrap_room=5)
            s.add_request(req)
            assert "boom" in req.sender.failure_reason()
            with pytest.raises(TransferDied, match="boom"):
                _run_until(s, lambda: not s.reqs.live)
        finally:
            transfer.close()
            worker.close()
