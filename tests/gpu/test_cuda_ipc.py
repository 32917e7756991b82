"""CUDA IPC between two processes: tensors, bundle fields, interprocess generation events,
host-fenced events and page-locked shared segments."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
import torch

import ipc
from ipc.cuda import CudaGenEvent, CudaIpcEvent, HostFencedEvent, PolledEvent
from ipc.events import ShmEvent
from mpprefill.worker.staging import pin_segments
from tests.gpu import children
from tests.gpu.children import GpuNote, pattern

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def peer():
    """A bound channel and a way to spawn its child; the child is reaped afterwards."""
    endpoint = ipc.ipc_endpoint(f"g-{uuid.uuid4().hex[:10]}")
    ch = ipc.Channel(endpoint, bind=True)
    started = []

    def spawn(target, *args):
        p = mp.get_context("spawn").Process(target=target, args=(endpoint, os.getpid(), *args))
        p.start()
        started.append(p)
        ch.set_peer(p.pid)
        return p

    yield ch, spawn
    for p in started:
        p.join(30)
        if p.is_alive():
            p.kill()
    ch.close()


def test_tensor_and_bundle_fields_round_trip(peer):
    ch, spawn = peer
    n = 4099
    # Three fields of one shape and dtype: one block, told apart only by their offsets.
    specs = {name: ((n,), torch.float32) for name in ("a", "b", "back", "c")}
    bundle = ipc.SharedBundle(specs, "unused", device="cuda")
    for i, name in enumerate(sorted(n for n in specs if n != "back")):
        bundle.tensors[name].copy_(pattern(n, 5 + i).cuda())
    torch.cuda.synchronize()
    spawn(children.open_and_reply)
    ch.put(GpuNote(5, handles=bundle.handles), timeout=60)
    reply = ch.get(timeout=120)
    assert reply.text == ",".join(["True"] * 6)
    assert torch.equal(bundle.tensors["back"].cpu(), pattern(n, 105))
    ch.put(GpuNote(-1), timeout=60)


def test_generation_event_orders_device_work_across_processes(peer):
    ch, spawn = peer
    with ipc.SharedTensor.create((1,), torch.int64, ipc.new_prefix("mppgpu")) as counter:
        cuda = CudaIpcEvent.create()
        event = CudaGenEvent(ShmEvent(counter.tensor, "late"), cuda)
        out = ipc.SharedTensor.create((1 << 20,), torch.float32, "unused", "cuda")
        spawn(children.record_late, counter.handle)
        ch.put(GpuNote(0, handles={"out": out.handle}, event=cuda.handle()), timeout=60)
        assert ch.get(timeout=60).text == "issued"
        assert not event.query(1)  # issued, published, but the device still sleeps
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            event.wait(1, timeout=30)  # a device-side wait: the host goes on
            seen = out.tensor.clone()
        stream.synchronize()
        assert bool((seen == 7.0).all())
        event.synchronize(1, timeout=30)
        assert event.query(1)
        ch.put(GpuNote(-1), timeout=60)


def test_host_fenced_event_publishes_only_once_complete():
    counter = ShmEvent(torch.zeros(1, dtype=torch.int64), "fenced")
    event = HostFencedEvent(counter)
    out = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(children.SLEEP_CYCLES)
    out.fill_(3.0)
    event.record(4)
    assert counter.value() == 0  # recorded on the stream, not yet published
    event.flush()
    assert counter.value() == 4 and event.query(4)
    assert bool((out == 3.0).all())


def test_polled_event_publishes_each_record_once_complete_without_flush():
    counter = ShmEvent(torch.zeros(1, dtype=torch.int64), "layers")
    event = PolledEvent(counter)
    out = torch.zeros(1 << 20, device="cuda")
    for gen in (1, 2, 3):  # three "layers", each behind a device-side sleep
        torch.cuda._sleep(children.SLEEP_CYCLES)
        out.fill_(float(gen))
        event.record(gen)
    assert counter.value() < 3  # recorded on the stream, not all complete yet
    event.wait(3, timeout=30)  # published by its thread, no flush asked
    assert counter.value() == 3 and bool((out == 3.0).all())


def test_pinned_segments_copy_asynchronously():
    bundle = ipc.SharedBundle({"x": ((1 << 16,), torch.int64)}, ipc.new_prefix("mppgpu"))
    try:
        views = ipc.open_bundle(bundle.handles)
        pinned = pin_segments(list(bundle.handles.values()))
        assert len(pinned) == 1 and views["x"].is_pinned()
        views["x"].copy_(torch.arange(1 << 16))
        dev = views["x"].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), torch.arange(1 << 16))
    finally:
        bundle.unlink()
