"""The emulated accelerator: the shrunken host batch, the device clock's timing, events
that fire at device time, and every mode through it."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from ipc.events import ShmEvent
from mpprefill.config import FORWARD_MODES, ServerArgs
from mpprefill.emulation.device import (
    EmulatedDevice,
    EmulatedStream,
    host_config,
    host_model,
    shrink,
)
from mpprefill.emulation.roofline import DeviceClock, head_parts_s, layer_parts_s, windowed_pairs
from mpprefill.emulation.shapes import resolve_shape
from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig

pytestmark = pytest.mark.timeout(300)


def _batch(extend: list[int], prefix: list[int]) -> ForwardBatch:
    ids = [[(7 * i + j) % 90 + 1 for j in range(e)] for i, e in enumerate(extend)]
    slots, base = [], 0
    for p, e in zip(prefix, extend):
        slots.append(list(range(base, base + p + e)))
        base += p + e
    return ForwardBatch.build(ids, prefix, slots)


def test_shrink_keeps_the_last_tokens_of_each_request():
    fb = _batch([20, 3, 9], [16, 0, 32])
    small = shrink(fb, keep=8)
    assert small.extend_lens.tolist() == [8, 3, 8]
    assert small.prefix_lens.tolist() == [0, 0, 0]
    rows = list(range(12, 20)) + list(range(20, 23)) + list(range(24, 32))
    assert small.input_ids.tolist() == fb.input_ids[rows].tolist()
    assert small.positions.tolist() == fb.positions[rows].tolist()
    assert torch.equal(small.kv_indices, fb.out_cache_loc[rows])
    small.validate()  # shapes agree; positions stay the real ones (not prefix + i)


def test_host_model_has_the_emulated_layer_count():
    cfg = host_config(ModelConfig.tiny(), "Llama-3.1-8B")
    assert cfg.num_hidden_layers == 32 and cfg.hidden_size == 32
    assert cfg.vocab_size == ModelConfig.tiny().vocab_size
    with pytest.raises(ValueError):
        host_config(ModelConfig.tiny(), "no-such-model")


def test_the_stand_in_of_an_moe_checkpoint_is_dense():
    moe = dataclasses.replace(
        ModelConfig.tiny(),
        architecture="Qwen3MoeForCausalLM",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        dense_mlp_layers=(3,),
    )
    cfg = host_config(moe, "Qwen2.5-0.5B")
    assert cfg.num_hidden_layers == 24 and not any(cfg.is_moe(i) for i in range(24))


def test_sliding_layers_keep_their_pattern_at_the_emulated_layer_count():
    tiny = ModelConfig.tiny()
    types = ("sliding_attention", "full_attention") * (tiny.num_hidden_layers // 2)
    sliding = dataclasses.replace(tiny, sliding_window=8, layer_types=types)
    cfg = host_config(sliding, "Qwen2.5-0.5B")
    assert cfg.num_hidden_layers == 24 and cfg.sliding_window == 8
    assert [cfg.is_sliding(i) for i in range(24)] == [i % 2 == 0 for i in range(24)]


def test_sliding_layers_cost_their_window_on_the_device():
    """At a prefix far past the window a sliding layer's attention sees W keys, so the
    forward costs the full layers' roofline plus the sliding layers' windowed one."""
    shape = resolve_shape("Llama-3.1-8B")
    dev = EmulatedDevice(shape, "h200")
    tiny = ModelConfig.tiny()
    types = ("sliding_attention", "full_attention") * (tiny.num_hidden_layers // 2)
    sliding = dataclasses.replace(tiny, sliding_window=256, layer_types=types)
    model = host_model(host_config(sliding, "Llama-3.1-8B"), seed=0)
    kv = KVCache.for_model(model.config, 1 << 16, num_swa_slots=1 << 16)
    extend, prefix = [512, 512], [16384, 0]
    dev.forward(model, _batch(extend, prefix), kv)
    full = sum(layer_parts_s(shape, dev.gpu, extend, prefix))
    windowed = sum(layer_parts_s(shape, dev.gpu, extend, prefix, window=256))
    assert windowed < 0.8 * full  # 16k keys against 256 for the long request
    want = 16 * full + 16 * windowed + sum(head_parts_s(shape, dev.gpu, 2))
    assert dev.last_forward()[2] == pytest.approx(want)


def test_gpt_oss_layers_slide_on_the_device_over_a_full_attention_stand_in():
    """The built-in model has no sliding layers, so the stand-in attends fully, but the
    device charges gpt-oss-20b's 12 even layers their window of 128 and the 12 odd ones
    full attention, every one with its experts."""
    shape = resolve_shape("gpt-oss-20b")
    dev = EmulatedDevice(shape, "h200")
    model = host_model(host_config(ModelConfig.tiny(), "gpt-oss-20b"), seed=0)
    assert not model.config.has_sliding_layers
    kv = KVCache.for_model(model.config, 1 << 16)
    extend, prefix = [512, 512], [16384, 0]
    dev.forward(model, _batch(extend, prefix), kv)
    full = sum(layer_parts_s(shape, dev.gpu, extend, prefix, sparse=True))
    windowed = sum(layer_parts_s(shape, dev.gpu, extend, prefix, window=128, sparse=True))
    assert windowed < 0.8 * full
    want = 12 * windowed + 12 * full + sum(head_parts_s(shape, dev.gpu, 2))
    assert dev.last_forward()[2] == pytest.approx(want)


def test_the_emulated_models_sparse_layers_cost_their_experts():
    """The device charges the experts on the emulated shape's sparse layers (every second
    one here, layer 1 kept dense) and a dense MLP on the rest; the host stand-in is dense."""
    shape = dataclasses.replace(resolve_shape("Qwen3-30B-A3B"), sparse_step=2, dense_layers=(1,))
    dev = EmulatedDevice(shape, "h200")
    model = host_model(host_config(ModelConfig.tiny(), "Qwen3-30B-A3B"), seed=0)
    assert not any(model.config.is_moe(i) for i in range(48))
    kv = KVCache.for_model(model.config, 4096)
    extend, prefix = [300, 200], [512, 0]
    dev.forward(model, _batch(extend, prefix), kv)
    dense = sum(layer_parts_s(shape, dev.gpu, extend, prefix))
    sparse = sum(layer_parts_s(shape, dev.gpu, extend, prefix, sparse=True))
    assert sparse > 1.5 * dense  # 128 experts' weights against one MLP's
    want = 25 * dense + 23 * sparse + sum(head_parts_s(shape, dev.gpu, 2))
    assert dev.last_forward()[2] == pytest.approx(want)


def test_windowed_pairs_count_each_querys_keys():
    for e, p, w in [(1, 0, 4), (10, 0, 4), (10, 2, 4), (3, 100, 4), (7, 1, 1), (5, 0, 100)]:
        assert windowed_pairs(e, p, w) == sum(min(p + j + 1, w) for j in range(e))


def test_device_time_follows_the_roofline_and_queues_behind_earlier_work():
    shape = resolve_shape("Qwen2.5-0.5B")
    dev = EmulatedDevice(shape, "h200")
    model = host_model(host_config(ModelConfig.tiny(), "Qwen2.5-0.5B"), seed=0)
    kv = KVCache.for_model(model.config, 4096)
    fb = _batch([300, 200], [512, 0])
    layer = sum(layer_parts_s(shape, dev.gpu, [300, 200], [512, 0]))
    want = shape.num_layers * layer + sum(head_parts_s(shape, dev.gpu, 2))
    dev.forward(model, fb, kv)
    start1, end1, busy1, collective1 = dev.last_forward()
    assert busy1 == pytest.approx(want)
    assert collective1 == 0.0  # one GPU: no collectives
    # The device waits for the host to issue each layer: the span is never shorter.
    assert (end1 - start1) / 1e9 >= want * (1 - 1e-9)
    dev.forward(model, fb, kv)
    start2, end2, _, _ = dev.last_forward()
    assert start2 >= end1 - 1000  # the second forward waits for the first on the device


def test_events_recorded_on_the_stream_fire_at_device_time():
    clock = DeviceClock()
    stream = EmulatedStream(clock)
    event = ShmEvent(torch.zeros(1, dtype=torch.int64), "e")
    finish = clock.issue(0.15)
    stream.record(event, 1)
    assert not event.query(1)
    event.wait(1, timeout=5)
    assert time.monotonic() >= finish - 1e-3
    stream.record(event, 2)  # nothing issued since: fires at once
    assert event.query(2)
    stream.drain()


@pytest.fixture(scope="module")
def emulated_reference():
    prompts = [[(11 * i + j) % 90 + 1 for j in range(40 + 13 * i)] for i in range(10)]
    prompts += [p[:30] + [5, 6, 7] for p in prompts[:4]]  # some prefix hits
    kw = dict(device="emulated", emulate_model="Qwen2.5-0.5B", chunked_prefill_size=64)
    kw["worker_threads"] = 1  # NOTE: two test workers share the cores; see test_engine
    with PrefillEngine(forward_mode="normal", **kw) as eng:
        ref = eng.prefill(prompts)
    return prompts, kw, ref


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_every_mode_runs_on_the_emulated_device(mode, emulated_reference):
    prompts, kw, ref = emulated_reference
    with PrefillEngine(forward_mode=mode, check_invariants=True, **kw) as eng:
        outs = eng.prefill(prompts, timeout=120)
        eng.check_invariants(flush=True)
        m = eng.scheduler.metrics
    assert [o.first_token for o in outs] == [o.first_token for o in ref]
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in ref]
    assert m.device_s > 0 and m.num_batches > 0


@pytest.mark.parametrize("mode", ["normal", "thread-ahead", "proc-ahead"])
def test_a_sliding_window_model_runs_on_the_emulated_device(mode, emulated_reference):
    """The sliding-window layers' own pool through the emulated device; a first token
    depends on the last token and its position only, so it equals the dense run's."""
    prompts, kw, ref = emulated_reference
    swa = dict(sliding_window=24, swa_layers="sf")
    with PrefillEngine(forward_mode=mode, check_invariants=True, **kw, **swa) as eng:
        outs = eng.prefill(prompts, timeout=120)
        eng.check_invariants(flush=True)
        assert eng.worker.kv_cache.swa_buffer is not None
    assert [o.first_token for o in outs] == [o.first_token for o in ref]


def test_first_token_does_not_depend_on_prefix_hits_or_chunking():
    """A shared prefix cached or not, one chunk or chunks of 16: the last chunk holds 67
    tokens in one run and 3 in the other, and the first tokens agree."""
    shared = [(5 * j) % 90 + 1 for j in range(64)]
    prompts = [shared + [7 + i, 8 + i, 9 + i] for i in range(4)]
    kw = dict(device="emulated", emulate_model="Qwen2.5-0.5B", forward_mode="normal")
    with PrefillEngine(chunked_prefill_size=512, disable_radix_cache=True, **kw) as eng:
        together = eng.prefill(prompts)  # no hits, one chunk each
    with PrefillEngine(chunked_prefill_size=16, **kw) as eng:
        apart = [eng.prefill([p])[0] for p in prompts]  # hits after the first
    assert [o.cached_tokens for o in together] == [0, 0, 0, 0]
    assert [o.cached_tokens for o in apart] == [0, 64, 64, 64]
    assert [o.first_token for o in apart] == [o.first_token for o in together]


def test_device_label_and_flags():
    a = ServerArgs(device="emulated", emulate_model="Llama-3.1-8B", emulate_gpu="b200")
    dev = a.worker_device
    assert dev.label == "emulated (b200, Llama-3.1-8B)"
    assert (dev.torch_device, dev.kind, dev.emulated, dev.on_cuda) == (
        "cpu",
        "emulated",
        True,
        False,
    )
    assert dev.group_size(4) == 1 and ServerArgs(device="cpu").worker_device.group_size(4) == 4
    with pytest.raises(ValueError, match="emulate-gpu"):
        ServerArgs(device="emulated", emulate_gpu="a100")
