"""The emulated accelerator at tensor parallel: a rank's shard of the roofline plus the
collectives over NVLink, on hand-checked numbers, and the engine through it."""

from __future__ import annotations

import pytest

from mpprefill.emulation.device import EmulatedDevice, host_config, host_model
from mpprefill.emulation.roofline import (
    GPUS,
    allgather_time_s,
    allreduce_time_s,
    head_parts_s,
    layer_parts_s,
)
from mpprefill.emulation.shapes import KERNELS_PER_LAYER, PRESETS
from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig

LLAMA_70B = PRESETS["Llama-3.1-70B"]
H200 = GPUS["h200"]


def test_70b_shards_over_eight_gpus():
    rank = LLAMA_70B.shard(8)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate) == (8, 1, 3584)
    assert rank.vocab == 16032 and rank.hidden == 8192
    assert LLAMA_70B.shard(1) is LLAMA_70B
    assert LLAMA_70B.shard(16).num_kv_heads == 1  # 8 KV heads over 16 GPUs: replicated
    with pytest.raises(ValueError, match="split over 3"):
        LLAMA_70B.shard(3)


def test_collectives_follow_the_ring_formulas():
    rate = 450e9 * 0.8
    nbytes = 8192 * 8192 * 2  # 8k tokens of 70B activations in bf16
    assert allreduce_time_s(H200, nbytes, 1) == 0.0
    assert allreduce_time_s(H200, nbytes, 8) == pytest.approx(2 * 7 / 8 * nbytes / rate + 10e-6)
    assert allgather_time_s(H200, nbytes, 4) == pytest.approx(3 / 4 * nbytes / rate + 10e-6)
    assert GPUS["b200"].link_rate == 2 * H200.link_rate


def test_tp_layer_is_its_shard_plus_two_allreduces():
    extend, prefix = [8192], [0]
    compute1, comm1 = layer_parts_s(LLAMA_70B, H200, extend, prefix)
    assert comm1 == 0.0
    for tp in (2, 4, 8):
        compute, comm = layer_parts_s(LLAMA_70B, H200, extend, prefix, tp)
        # A compute-bound 8k batch: each GPU does about 1/tp of the work, its narrower
        # GEMMs a little less efficiently.
        assert compute1 / tp < compute < 1.15 * compute1 / tp
        assert comm == pytest.approx(2 * allreduce_time_s(H200, 8192 * 8192 * 2, tp))
    # One token: the launch floor stays, so the collectives do not pay off.
    small = sum(layer_parts_s(LLAMA_70B, H200, [1], [0], 8))
    assert small >= KERNELS_PER_LAYER * H200.kernel_floor_s + 2 * 10e-6


def test_tp_head_gathers_the_logits():
    one = sum(head_parts_s(LLAMA_70B, H200, 4))
    eight = sum(head_parts_s(LLAMA_70B, H200, 4, 8))
    gather = allgather_time_s(H200, 4 * LLAMA_70B.vocab * 4, 8)
    assert eight - gather < one / 4 and eight > gather


def test_emulated_device_reports_its_collective_seconds():
    """At TP 2 a forward's collectives are two all-reduces of the T x hidden activations per
    layer and the all-gather of the logits; at TP 1 there are none."""
    shape = PRESETS["Llama-3.1-8B"]
    model = host_model(host_config(ModelConfig.tiny(), "Llama-3.1-8B"), seed=0)
    kv = KVCache.for_model(model.config, 2048)
    extend, prefix = [300, 200], [512, 0]
    ids = [[(5 * i + j) % 90 + 1 for j in range(e)] for i, e in enumerate(extend)]
    slots = [list(range(0, 812)), list(range(812, 1012))]
    fb = ForwardBatch.build(ids, prefix, slots)
    allreduce = allreduce_time_s(H200, 500 * shape.hidden * shape.dtype_bytes, 2)
    gather = allgather_time_s(H200, 2 * shape.vocab * 4, 2)  # float32 logits of 2 requests
    want = {1: 0.0, 2: shape.num_layers * 2 * allreduce + gather}
    for tp in (1, 2):
        dev = EmulatedDevice(shape, "h200", tp)
        dev.forward(model, fb, kv)
        _, _, busy, collective = dev.last_forward()
        assert collective == pytest.approx(want[tp], abs=1e-12)
        assert busy == pytest.approx(
            shape.num_layers * sum(layer_parts_s(shape, H200, extend, prefix, tp))
            + sum(head_parts_s(shape, H200, 2, tp))
        )
    assert 0 < collective < busy


def test_emulated_device_refuses_a_shape_that_does_not_split():
    with pytest.raises(ValueError, match="split over 4"):
        EmulatedDevice.of("Qwen2.5-0.5B", "h200", tp_size=4)  # 14 heads


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["thread-ahead", "proc-ahead"])
def test_engine_charges_one_rank_of_the_group(mode):
    """At TP 8 the same batches cost each GPU far less device time than at TP 1, and the
    first tokens (the host model's) do not change."""
    prompts = [[(i * 7 + j) % 4000 + 1 for j in range(512)] for i in range(4)]
    firsts, device_s = {}, {}
    for tp in (1, 8):
        with PrefillEngine(
            forward_mode=mode,
            device="emulated",
            emulate_model="Llama-3.1-70B",
            tp_size=tp,
            chunked_prefill_size=2048,
            max_prefill_tokens=2048,
        ) as eng:
            firsts[tp] = [o.first_token for o in eng.prefill(prompts)]
            device_s[tp] = eng.scheduler.metrics.device_s
            if mode == "proc-ahead":
                assert len(eng.worker.ranks) == 1  # one process models the group's device
    assert firsts[1] == firsts[8]
    assert device_s[8] < device_s[1] / 4
