"""The emulated accelerator's host side: the launch cost spent per layer with the GIL
released, and the issue-free control that skips the stand-in's layers."""

from __future__ import annotations

import threading

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.emulation import device as emulated
from mpprefill.emulation.device import EmulatedDevice, LaunchCost, host_config, host_model, shrink
from mpprefill.emulation.roofline import head_parts_s, layer_parts_s
from mpprefill.emulation.setup import clock_for
from mpprefill.emulation.shapes import (
    KERNELS_PER_HEAD,
    KERNELS_PER_LAYER,
    KERNELS_PER_MOE_LAYER,
    resolve_shape,
)
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig

pytestmark = pytest.mark.timeout(120)


def _batch(extend: list[int], prefix: list[int]) -> ForwardBatch:
    ids = [[(5 * i + j) % 90 + 1 for j in range(e)] for i, e in enumerate(extend)]
    slots, base = [], 0
    for p, e in zip(prefix, extend):
        slots.append(list(range(base, base + p + e)))
        base += p + e
    return ForwardBatch.build(ids, prefix, slots)


class _Recorder(LaunchCost):
    """Records each lump's kernels instead of spending it."""

    def __init__(self):
        super().__init__(5.0)
        self.lumps: list[int] = []

    def spend(self, kernels: int) -> None:
        self.lumps.append(kernels)


def _device_and_model(name: str, issue: str = "model"):
    dev = EmulatedDevice(resolve_shape(name), "h200", issue=issue)
    model = host_model(host_config(ModelConfig.tiny(), name), seed=0)
    return dev, model, KVCache.for_model(model.config, 4096)


def test_no_cost_spends_nothing_and_a_negative_one_is_refused(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.special, "zeta", lambda *a, **k: calls.append(a))
    cost = LaunchCost(0.0)
    cost.spend(10)
    assert calls == [] and cost.landed() is None and cost._buffers is None
    with pytest.raises(ValueError, match="negative"):
        LaunchCost(-1.0)
    with pytest.raises(ValueError, match="emulate-launch-us"):
        ServerArgs(device="emulated", emulate_launch_us=-2.0)
    with pytest.raises(ValueError, match="emulate-issue"):
        ServerArgs(device="emulated", emulate_issue="none")


def test_each_lump_is_sized_from_the_fitted_cost_and_the_fit_follows_what_lumps_took(
    monkeypatch,
):
    """t(n) = a + b·n, with a = 2 us and b = 10 ns after calibration: 10 kernels of 5 us are
    (50 - 2) / 0.01 = 4,800 elements. The op then takes 3 us + 20 ns an element on the
    thread's clock (the buffer out of cache): b moves a tenth of the way to the seen 20.2 ns."""
    cost = LaunchCost(5.0)

    def calibrate():
        cost._buffers = (torch.ones(cost.MAX_LEN),) * 3
        cost._fixed_s, cost._per_elem_s = 2e-6, 10e-9

    monkeypatch.setattr(cost, "_calibrate", calibrate)
    clock = [0.0]
    sizes = []

    def zeta(x, q, out):
        sizes.append(len(x))
        clock[0] += 3e-6 + 20e-9 * len(x)

    monkeypatch.setattr(torch.special, "zeta", zeta)
    monkeypatch.setattr(emulated.time, "thread_time", lambda: clock[0])
    cost.spend(10)
    assert sizes == [4800]
    seen = (3e-6 + 20e-9 * 4800 - 2e-6) / 4800
    assert cost._per_elem_s == pytest.approx(10e-9 + 0.1 * (seen - 10e-9))
    assert cost.asked_s == pytest.approx(50e-6)
    assert cost.spent_s == pytest.approx(3e-6 + 20e-9 * 4800)
    assert cost.landed() == pytest.approx(cost.spent_s / 50e-6)
    fitted = cost._per_elem_s
    cost.spend(10)  # the next lump is shorter: the op was dearer than fitted
    assert sizes[1] == round((50e-6 - 2e-6) / fitted) < 4800
    cost.spend(100_000)  # a lump past the buffer is capped at it
    assert sizes[2] == cost.MAX_LEN


def test_a_cost_first_spent_inside_inference_mode_is_spent_outside_it_too():
    """The layers' lumps run inside the forward's inference mode, the head's may not."""
    cost = LaunchCost(1.0)
    with torch.inference_mode():
        cost.spend(3)
    cost.spend(3)
    assert cost.asked_s == pytest.approx(6e-6)


def test_the_lump_is_spent_with_the_gil_released():
    """A Python thread keeps counting while the forward's thread spends a long lump: the
    GIL was free for it the whole time (a sleep would show the same; a Python spin would
    not let it run beyond its switch intervals)."""
    cost = LaunchCost(2000.0)  # 20 ms for 10 kernels
    cost.spend(1)  # calibrated
    stop = threading.Event()
    ticks = [0]

    def count():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count)
    t.start()
    try:
        before = ticks[0]
        cost.spend(10)
        during = ticks[0] - before
    finally:
        stop.set()
        t.join(timeout=10)
    assert cost.spent_s > 0 and during > 1000


def test_every_layer_and_the_head_spend_their_kernels_launches():
    dev, model, kv = _device_and_model("Qwen3-30B-A3B")
    dev.launch = recorder = _Recorder()
    dev.forward(model, _batch([30, 7], [16, 0]), kv)
    shape = dev.shape
    want = [KERNELS_PER_MOE_LAYER if shape.is_sparse(i) else KERNELS_PER_LAYER for i in range(48)]
    assert recorder.lumps == want + [KERNELS_PER_HEAD]
    assert KERNELS_PER_MOE_LAYER in recorder.lumps


def test_the_launch_flag_reaches_the_emulated_device():
    args = ServerArgs(device="emulated", emulate_launch_us=4.5, emulate_issue="free")
    dev = clock_for(args.worker_device)
    assert dev.launch.per_kernel_s == pytest.approx(4.5e-6) and dev.issue == "free"


def test_free_issue_skips_the_stand_ins_layers_but_charges_them_on_the_device():
    """The control where the forward's host issue costs next to nothing: the same device
    time as a full issue, logits from the stand-in's embedding, norm and head alone, and
    a fraction of the torch calls."""
    extend, prefix = [30, 7, 12], [16, 0, 64]
    full_dev, model, kv = _device_and_model("Qwen2.5-0.5B")
    free_dev, _, _ = _device_and_model("Qwen2.5-0.5B", issue="free")
    layers_run = []
    for layer in model.layers:
        layer.register_forward_hook(lambda *a: layers_run.append(1))
    fb = _batch(extend, prefix)
    full_logits = full_dev.forward(model, fb, kv)
    assert len(layers_run) == 24
    free_logits = free_dev.forward(model, fb, kv)
    assert len(layers_run) == 24  # none of them ran
    shape = free_dev.shape
    want = 24 * sum(layer_parts_s(shape, free_dev.gpu, extend, prefix))
    want += sum(head_parts_s(shape, free_dev.gpu, 3))
    assert free_dev.last_forward()[2] == pytest.approx(want)
    assert full_dev.last_forward()[2] == pytest.approx(want)
    small = shrink(fb)
    with torch.inference_mode():
        head = model.output(model.norm(model.tok_embeddings(small.input_ids))).float()
    assert torch.equal(free_logits, head)
    assert free_logits.shape == full_logits.shape
    # The device still runs behind the host: the clock holds the layers' time.
    start, end, _, _ = free_dev.last_forward()
    assert (end - start) / 1e9 >= want - 2e-9  # start and end are whole nanoseconds
