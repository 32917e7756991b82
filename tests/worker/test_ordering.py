"""The ordering logic every device shares, exercised on the CPU: which event class and
staging each plan selects, the WAR barrier, the result wait, and the forward-done fence
that KV readers (the transfer backend, early send of a cached prefix) pass first."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from ipc.cuda import HostFencedEvent, PolledEvent
from ipc.events import EventAbandoned, EventTimeout, ShmEvent
from mpprefill.config import ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.streams import HostStream
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import NUM_EVENTS, SchedulerOrder, WorkerOrder, make_events
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.hooks import DeviceHooks, LaggingStream
from mpprefill.worker.process import ProcessWorker
from mpprefill.worker.staging import (
    CudaIpcStaging,
    ShmStaging,
    make_staging,
    read_slot,
    staging_class,
    staging_specs,
    write_slot,
)
from tests.worker.helpers import RecordingTransfer, forward_input

pytestmark = pytest.mark.timeout(180)
PLANS = {
    "cpu": DevicePlan.of("cpu", "pinned"),
    "pinned": DevicePlan.of("cuda", "pinned"),
    "cuda-ipc": DevicePlan.of("cuda", "cuda-ipc"),
}


# ---- selection -------------------------------------------------------------------------


def test_plan_follows_device_and_staging_flags():
    assert DevicePlan.of("cpu", "cuda-ipc") == DevicePlan("cpu", "shm")
    assert DevicePlan.of("cuda:0", "pinned") == DevicePlan("cuda", "pinned")
    assert ServerArgs().staging == "pinned"
    with pytest.raises(ValueError, match="staging"):
        ServerArgs(staging="nvlink")
    with pytest.raises(ValueError):
        DevicePlan("cpu", "cuda-ipc")


@pytest.mark.parametrize(
    "plan, scheduler, worker",
    [
        # (recorded by the scheduler, recorded by the worker) as each side holds them
        ("cpu", ("shm", "shm"), ("shm", "shm")),
        ("pinned", ("shm", "shm"), ("shm", "fenced")),
        ("cuda-ipc", ("cuda", "cuda"), ("cuda", "cuda")),
    ],
)
def test_event_kinds_per_plan(plan, scheduler, worker):
    p = PLANS[plan]
    by = ("scheduler", "worker")
    assert tuple(p.event_kind("scheduler", r) for r in by) == scheduler
    assert tuple(p.event_kind("worker", r) for r in by) == worker


@pytest.mark.parametrize("plan", ["cpu", "pinned"])
def test_events_built_without_cuda(plan):
    """Neither side of pinned staging creates CUDA objects before recording."""
    table = torch.zeros(NUM_EVENTS, dtype=torch.int64)
    sched, handles = make_events(PLANS[plan], "scheduler", table)
    worker, _ = make_events(PLANS[plan], "worker", table)
    assert handles == {} and all(type(e) is ShmEvent for e in sched.all())
    assert all(type(e) is ShmEvent for e in worker.staged)
    kind = HostFencedEvent if plan == "pinned" else ShmEvent
    assert all(type(e) is kind for e in [*worker.reads_done, worker.forward_done])
    assert type(worker.result_ready) is kind
    # each layer's completion: published by the worker's own thread on a GPU, read bare
    assert type(worker.layers_done) is (PolledEvent if plan == "pinned" else ShmEvent)


def test_staging_and_stream_selection():
    assert staging_class(PLANS["cpu"]) is ShmStaging
    assert staging_class(PLANS["pinned"]) is ShmStaging  # the worker page-locks it
    assert staging_class(PLANS["cuda-ipc"]) is CudaIpcStaging
    assert CudaIpcStaging.non_blocking and not ShmStaging.non_blocking
    assert [staging_class(p).device for p in PLANS.values()] == ["cpu", "cpu", "cuda"]
    specs = staging_specs(64, 2, 128)
    staging = make_staging(specs, "mpptest-sel", PLANS["cpu"])
    try:
        assert type(staging) is ShmStaging and len(staging.bundles) == 2
        assert staging.bundles[0].tensors["input_ids"].device.type == "cpu"
    finally:
        staging.unlink()
    assert type(DeviceHooks().stream(PLANS["cpu"])) is HostStream
    assert DeviceHooks.from_env({"MPPREFILL_TEST_SLOW_DEVICE": "0.01"}).slow_device_s == 0.01
    stream = DeviceHooks(slow_device_s=0.01).stream(PLANS["cpu"])
    assert isinstance(stream, LaggingStream)
    stream.drain()


def test_read_slot_copies_when_the_slot_lives_elsewhere():
    slot = {n: torch.zeros(s, dtype=d) for n, (s, d) in staging_specs(32, 2, 64).items()}
    snap = forward_input(1, list(range(1, 21)), list(range(20)), vocab=100)
    counts = write_slot(slot, snap.forward, snap.sampling)
    fb, sampling, copied = read_slot(slot, *counts)
    assert not copied and fb.input_ids.data_ptr() == slot["input_ids"].data_ptr()
    fb, sampling, copied = read_slot(slot, *counts, device="meta")  # a device without data
    assert copied and fb.kv_indices.device.type == "meta" and len(fb.kv_indices) == 20
    assert sampling.all_greedy and sampling.top_ps.device.type == "meta"


# ---- the order itself --------------------------------------------------------------------


def _orders(alive=lambda: True):
    table = torch.zeros(NUM_EVENTS, dtype=torch.int64)
    sched, _ = make_events(PLANS["cpu"], "scheduler", table)
    work, _ = make_events(PLANS["cpu"], "worker", table)
    record = HostStream().record
    return SchedulerOrder(sched, alive, timeout=5), WorkerOrder(work, alive, record, timeout=5)


def _later(delay: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()), daemon=True)
    t.start()
    return t


def test_war_barrier_waits_for_the_last_reader_of_the_slot():
    sched, work = _orders()
    t0 = time.monotonic()
    for seq in (1, 2):  # first use of each slot: nothing to wait for
        sched.before_write(seq % 2)
        sched.after_write(seq % 2, seq)
        work.before_read(seq % 2, seq)  # staged already
    work.reads_done(0, 2)
    assert time.monotonic() - t0 < 0.1
    _later(0.2, lambda: work.reads_done(1, 1))
    sched.before_write(1)  # forward 1 still reads slot 1
    assert time.monotonic() - t0 >= 0.19
    sched.before_write(0)


def test_result_wait_and_dead_worker():
    sched, work = _orders()
    _later(0.1, lambda: work.result_ready(4))
    sched.before_result(4, timeout=5)
    dead, _ = _orders(alive=lambda: False)
    with pytest.raises(EventAbandoned):
        dead.before_result(6, timeout=5)
    with pytest.raises(EventTimeout):
        sched.before_result(6, timeout=0.05)


def test_fence_requires_the_last_writer_of_each_page():
    sched, work = _orders()
    fence = KVWriteFence(8, 4, sched.kv_written, sched.kv_written_query)
    fence.note_writes(3, torch.arange(0, 6))  # pages 0, 1 (partly)
    fence.note_writes(5, torch.arange(6, 12))  # pages 1 (rest), 2
    assert fence.required(torch.tensor([0])) == 3
    assert fence.required(torch.tensor([0, 1])) == 5
    assert fence.required(torch.tensor([7])) == 0 and fence.done(0)
    work.forward_done(3)
    assert fence.done(3) and not fence.done(5)
    t0 = time.monotonic()
    _later(0.2, lambda: work.forward_done(5))
    fence.wait(fence.required(torch.tensor([2])))
    assert time.monotonic() - t0 >= 0.19


@pytest.mark.parametrize("fenced", [True, False])
def test_transfer_reads_pages_only_after_their_forward(fenced):
    """A send enqueued while the forward that writes its pages is still running: the
    transfer thread must read the written KV, not what was there before."""
    sched, work = _orders()
    kv = KVCache(2, 64, 1, 4)
    fence = KVWriteFence(4, 16, sched.kv_written, sched.kv_written_query)
    backend = RecordingTransfer(kv, 16, fence=fence if fenced else None)
    try:
        fence.note_writes(1, torch.arange(16, 48))  # forward 1 writes pages 1 and 2

        def forward() -> None:
            kv.buffer[:, :, 16:48] = 1.0
            work.forward_done(1)

        device = _later(0.3, forward)
        backend.ready_sender(7, 2).send(torch.tensor([1, 2]), last=True, first_token=0)
        (read,) = backend.wait_reads()
        device.join()
    finally:
        backend.close()
    assert bool((read == 1.0).all()) is fenced


# ---- through the forward process -----------------------------------------------------------


def _small_args(**kw) -> ServerArgs:
    base = dict(
        page_size=16,
        max_total_tokens=512,
        max_running_requests=2,
        chunked_prefill_size=64,
        max_prefill_tokens=64,
        context_length=256,
    )
    return ServerArgs(**{**base, **kw})


@pytest.fixture(scope="module")
def lagging_worker():
    """(a forward process whose device lags 0.4 s, the seqs to submit with), shared by the
    cases below: each writes pages no forward wrote before, so each reads as on a fresh one."""
    worker = ProcessWorker(_small_args().worker_config(), DeviceHooks(slow_device_s=0.4))
    try:
        yield worker, itertools.count(1)
    finally:
        worker.close()


@pytest.mark.parametrize(("fenced", "pages"), [(True, [2, 3]), (False, [4, 5])])
def test_early_send_waits_for_the_forward_in_flight(fenced, pages, lagging_worker):
    """The device lags: the worker replies before its forward ran. An early send of
    pages that forward writes (a cached prefix whose last chunk is still computing, the
    upstream race) must read them only after "forward done"."""
    worker, seqs = lagging_worker
    slots = list(range(pages[0] * 16, (pages[-1] + 1) * 16))
    backend = None
    try:
        assert type(worker.staging) is ShmStaging
        assert all(type(e) is ShmEvent for e in worker.order.events.all())
        assert worker.kv_cache.buffer[:, :, slots].abs().sum() == 0  # no forward wrote them
        backend = RecordingTransfer(worker.kv_cache, 16, fence=worker.kv_fence if fenced else None)
        vocab = worker.model_config.vocab_size
        worker.submit(forward_input(next(seqs), list(range(1, 33)), slots, vocab))
        backend.ready_sender(3, 2).send(torch.tensor(pages), last=True, first_token=0)
        (read,) = backend.wait_reads()
        result = worker.collect(timeout=30)
        final = worker.kv_cache.buffer[:, :, slots]
        assert result.next_token_ids is not None and final.abs().sum() > 0
        assert torch.equal(read, final) is fenced
    finally:
        if backend is not None:
            backend.close()


def test_lagging_device_gives_the_same_tokens(monkeypatch):
    """Replies precede results in every proc mode; readers wait on "result ready"."""
    prompts = [[(7 * i) % 90 + 1] * (20 + 9 * i) for i in range(6)]
    kw = dict(max_running_requests=2, chunked_prefill_size=32, check_invariants=True)
    kw["worker_threads"] = 1  # NOTE: two test workers share the cores; see test_engine
    with PrefillEngine(forward_mode="normal", **kw) as eng:
        ref = eng.prefill(prompts, return_logits=True)
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_DEVICE", "0.05")
    for mode in ("proc", "proc-ahead"):
        with PrefillEngine(forward_mode=mode, delay_sampling=mode == "proc", **kw) as eng:
            outs = eng.prefill(prompts, return_logits=True, timeout=120)
        assert [o.first_token for o in outs] == [o.first_token for o in ref]
        for o, r in zip(outs, ref):
            torch.testing.assert_close(o.logits, r.logits, atol=1e-4, rtol=1e-4)
