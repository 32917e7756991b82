"""The forward process: O(1) mailbox bytes, the WAR barrier, and death of the worker."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import ipc
from mpprefill.engine import PrefillEngine
from mpprefill.worker.api import WorkerDied
from mpprefill.worker.events import SchedulerOrder

pytestmark = pytest.mark.timeout(180)


def _segments_of(eng) -> list[str]:
    return ipc.list_segments(eng.worker.prefix)


def test_mailbox_bytes_do_not_grow_with_batch_tokens():
    with PrefillEngine(
        forward_mode="proc", chunked_prefill_size=4096, max_prefill_tokens=4096
    ) as eng:
        eng.prefill([[1] * 16])
        eng.prefill([[2] * 4096])
        small, large = eng.scheduler.metrics.mailbox_bytes[-2:]
    assert eng.scheduler.metrics.num_batches == 2
    # Only the digits of the counts differ (16 vs 4096 tokens, 16 vs 4096 kv indices).
    assert 0 <= large - small <= 8, (small, large)
    assert large < 4096


@pytest.mark.parametrize("device_lag", ["0", "0.02"])
def test_war_barrier_holds_against_late_reads(monkeypatch, device_lag):
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_READS", "0.2")
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_DEVICE", device_lag)  # replies before the forward
    prompts = [[i + 1] * (20 + i) for i in range(8)]
    with PrefillEngine(
        forward_mode="proc-ahead", max_running_requests=1, check_invariants=True
    ) as eng:
        outs = eng.prefill(prompts)
    assert len(outs) == 8 and eng.scheduler.metrics.num_batches == 8


def test_war_violation_is_caught_without_the_barrier(monkeypatch):
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_READS", "0.3")
    monkeypatch.setattr(SchedulerOrder, "before_write", lambda self, slot: None)
    prompts = [[i + 1] * (20 + i) for i in range(8)]
    with PrefillEngine(forward_mode="proc-ahead", max_running_requests=1) as eng:
        with pytest.raises(WorkerDied, match="rewritten"):
            eng.prefill(prompts)
        assert _segments_of(eng) == []


def test_worker_sigkill_fails_every_request_fast():
    prompts = [[(i % 50) + 1] * 300 for i in range(40)]
    with PrefillEngine(
        forward_mode="proc-ahead", max_running_requests=2, chunked_prefill_size=64
    ) as eng:
        finished = []
        eng.scheduler.reqs.on_finish = finished.append
        pid = eng.worker.pid
        killed_at = []

        def kill():
            time.sleep(1.0)
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()
        with pytest.raises(WorkerDied, match="died"):
            eng.prefill(prompts)
        noticed = time.monotonic()
        assert killed_at and noticed - killed_at[0] < 1.5  # liveness bound
        assert len(finished) == len(prompts)
        failed = [r for r in finished if r.error]
        assert failed and all("died" in r.error for r in failed)
        assert _segments_of(eng) == []


def _rss_shmem_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("RssShmem:"))
    return int(line.split()[1]) * 1024


def test_the_forward_process_maps_its_whole_kv_pool_at_start():
    """Its forwards then take no page faults on the pool (an in-process pool is written
    whole by torch.zeros); nothing has been computed yet."""
    with PrefillEngine(forward_mode="proc", max_total_tokens=1 << 16) as eng:
        pool = eng.worker.kv_cache.storage
        nbytes = pool.numel() * pool.element_size()
        assert nbytes >= 32 << 20  # large enough to tell a mapped pool from a lazy one
        assert _rss_shmem_bytes(eng.worker.pid) >= nbytes
