"""The scheduler and its transfer backend's thread: an abort in Transferring waits for the
copy under way before the release and the reply; a dead transfer thread stops the loop."""

from __future__ import annotations

import threading
import time

import pytest

from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.sender import TransferDied
from mpprefill.disagg.shm_backend import ShmTransfer
from mpprefill.modes import MODES
from mpprefill.scheduling.invariants import check_drained
from mpprefill.scheduling.loops import event_loop_normal
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE, Router, serving

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


def test_an_abort_while_pages_are_copied_releases_after_the_copy_and_replies_after():
    rx = DecodeReceiver(DecodeArgs(receiver_port=0, max_total_tokens=1024))
    fence = GateFence()
    args = _args(rx.address)
    worker, config = make_worker(args, MODES["normal"])
    transfer = make_transfer("shm", worker.kv_cache, PAGE, rx.address, fence=fence)
    finished = []
    with serving(rx), Router(rx.address) as router:
        try:
            s = Scheduler(args, config, worker, transfer, on_finish=finished.append)
            req = Req("t", list(range(1, 40)), bootstrap_room=77)
            router.register("t", 77, req.origin_input_ids)
            s.add_request(req)
            _run_until(s, fence.reached.is_set)  # its last send waits at the copy
            assert req.status == ReqStatus.TRANSFERRING
            assert s.reqs.abort("t")
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                s.reqs.process_inflight_queue()
                assert not finished and req.req_pool_idx is not None  # still being copied
            fence.open.set()
            _run_until(s, lambda: bool(finished))
            assert finished == [req] and "aborted" in req.error
            assert req.req_pool_idx is None
            check_drained(s)
            assert router.recv()["status"] == "error"
        finally:
            fence.open.set()
            transfer.close()
            worker.close()


class DyingTransfer(ShmTransfer):
    """A backend whose thread fails on its first tick (a bug, not a peer's doing)."""

    def _tick(self, now: float) -> None:
        raise RuntimeError("boom")


def test_a_dead_transfer_thread_stops_the_scheduler():
    rx = DecodeReceiver(DecodeArgs(receiver_port=0, max_total_tokens=1024))
    args = _args(rx.address)
    worker, config = make_worker(args, MODES["normal"])
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
