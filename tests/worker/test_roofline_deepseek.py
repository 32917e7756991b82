"""The DeepSeek-V3 preset: latent attention and shared experts in the roofline on
hand-computed FLOPs and bytes, its per-token FLOPs against DeepSeek's published 37B
activated parameters, its latent KV bytes, its shape from config.json, and the host
stand-in of a DeepSeek checkpoint on the emulated device."""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.emulation.device import EmulatedDevice, host_config, host_model
from mpprefill.emulation.roofline import (
    GPUS,
    GpuSpec,
    head_kernels,
    host_copy_time_s,
    layer_kernels,
)
from mpprefill.emulation.shapes import DEEPSEEK_V3_CONFIG, PRESETS, ModelShape
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch
from mpprefill.model.families import config_from_hf

H200 = GPUS["h200"]
DSV3 = PRESETS["DeepSeek-V3"]
# FLOPs so fast, and no floor, that every kernel takes its bytes over 1 GB/s.
MEMORY_BOUND = GpuSpec("unit", flops=1e18, bandwidth=1e9, memory_efficiency=1.0, kernel_floor_s=0.0)

# DeepSeek-V3 by hand (config.json): h 7168, q rank 1536, latent 512 + rope 64, 128 heads
# of q/k 128 + 64 and v 128; a dense MLP of 18432 rows; 256 experts of 2048 rows, 8 a
# token, and one shared expert of 2048 rows.
Q_KV_A = 7168 * (1536 + 512 + 64)  # 15,138,816
Q_B = 1536 * 128 * (128 + 64)  # 37,748,736
KV_B = 512 * 128 * (128 + 128)  # 16,777,216
O_PROJ = 128 * 128 * 7168  # 117,440,512
ATTENTION_PARAMS = Q_KV_A + Q_B + KV_B + O_PROJ  # 187,105,280
DENSE_MLP = 3 * 7168 * 18432  # 396,361,728
EXPERT = 3 * 7168 * 2048  # 44,040,192
SPARSE_MLP = 7168 * 256 + (8 + 1) * EXPERT  # router, 8 routed and the shared: 398,196,736
HEAD = 7168 * 129280
# Each query-key pair: q.k over 192 dims and p.v over 128, in each of 128 heads.
PAIR_FLOPS = 2 * 128 * (192 + 128)  # 81,920


def _flops(kernels) -> float:
    return sum(k.flops for k in kernels)


def test_the_preset_is_deepseek_v3s_config():
    s = DSV3
    assert (s.num_layers, s.hidden, s.intermediate, s.vocab) == (61, 7168, 18432, 129280)
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (128, 128, 64)
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.v_head_dim) == (
        1536,
        512,
        128,
        128,
    )
    assert (s.num_experts, s.experts_per_tok, s.moe_intermediate) == (256, 8, 2048)
    assert s.shared_intermediate == 2048
    assert [i for i in range(61) if not s.is_sparse(i)] == [0, 1, 2]
    assert s.dtype_bytes == s.kv_dtype_bytes == 2
    assert s.attention_params == ATTENTION_PARAMS


@pytest.mark.parametrize(("tokens", "prefix"), [(1, 0), (512, 0), (300, 2000)])
def test_a_layers_flops_by_hand(tokens, prefix):
    """Every GEMM's 2·M·N·K over T new tokens after a prefix of p: the linear layers T times
    their weights, kv_b p + T times (every key's row is decompressed), attention its pairs."""
    pairs = tokens * (prefix + (tokens + 1) / 2)
    attention = 2 * tokens * (Q_KV_A + Q_B + O_PROJ) + 2 * (prefix + tokens) * KV_B
    attention += PAIR_FLOPS * pairs
    dense = layer_kernels(DSV3, H200, [tokens], [prefix])
    sparse = layer_kernels(DSV3, H200, [tokens], [prefix], sparse=True)
    assert _flops(dense) == pytest.approx(attention + 2 * tokens * DENSE_MLP)
    assert _flops(sparse) == pytest.approx(attention + 2 * tokens * SPARSE_MLP)


def test_a_tokens_flops_are_twice_the_37b_activated_parameters():
    """One token alone: its forward's FLOPs over two, with the embedding row it reads, are
    the parameters it activates; DeepSeek-V3's report says 37B (of 671B)."""
    layers = [layer_kernels(DSV3, H200, [1], [0], sparse=DSV3.is_sparse(i)) for i in range(61)]
    flops = sum(_flops(k) for k in layers) + _flops(head_kernels(DSV3, H200, 1))
    by_hand = 61 * ATTENTION_PARAMS + 3 * DENSE_MLP + 58 * SPARSE_MLP + HEAD
    assert flops == pytest.approx(2 * by_hand + PAIR_FLOPS * 61, rel=1e-12)
    activated = by_hand + 7168 * 129280  # the embedding row
    assert 37.0e9 < activated < 38.0e9
    total = activated + 58 * (256 - 8) * EXPERT
    assert 671e9 < total < 672e9


def test_the_latent_kv_bytes():
    """(512 + 64) elements of 2 bytes a token and layer, whole on every rank of a group."""
    assert DSV3.kv_bytes_per_token == 1152
    assert DSV3.shard(8).kv_bytes_per_token == 1152
    assert DSV3.num_layers * DSV3.kv_bytes_per_token == 70_272
    assert dataclasses.replace(DSV3, kv_dtype_bytes=4).kv_bytes_per_token == 2304
    seconds = host_copy_time_s(DSV3, H200, 1000, 61, tp=8)
    assert seconds == pytest.approx(1000 * 70_272 / (64e9 * 0.8) + 2 * 3e-6)


def test_tp_splits_heads_and_mlps_but_not_the_latent():
    rank = DSV3.shard(8)
    assert (rank.num_heads, rank.intermediate, rank.moe_intermediate) == (16, 2304, 256)
    assert (rank.shared_intermediate, rank.kv_lora_rank, rank.q_lora_rank) == (256, 512, 1536)
    whole = {k.name: k.flops for k in layer_kernels(DSV3, H200, [512], [0], sparse=True)}
    eighth = {k.name: k.flops for k in layer_kernels(DSV3, H200, [512], [0], 8, sparse=True)}
    assert eighth["q_kv_a_proj"] == whole["q_kv_a_proj"]  # replicated on every rank
    assert eighth["router"] == whole["router"]
    for name in ("q_b_proj", "kv_b_proj", "attention", "o_proj", "experts_gate_up"):
        assert eighth[name] == pytest.approx(whole[name] / 8), name
    assert eighth["shared_down_proj"] == pytest.approx(whole["shared_down_proj"] / 8)


# A latent shape small enough to follow by hand, 1 byte an element: hidden 4, 2 heads of
# q/k 4 + 2 (rope) and v 3, q rank 5, latent 3 + 2; a dense MLP of 8 rows; 4 experts of
# 3 rows, top 2, one shared expert of 3 rows.
TINY = ModelShape(
    1, 4, 8, 2, 2, 2, 16, dtype_bytes=1, kv_dtype_bytes=1,
    kv_lora_rank=3, q_lora_rank=5, qk_nope_head_dim=4, v_head_dim=3,
)  # fmt: skip
TINY_MOE = dataclasses.replace(
    TINY, num_experts=4, experts_per_tok=2, moe_intermediate=3, shared_intermediate=3
)
# One request of 2 new tokens after 3 cached: T = 2, keys = 5, pairs = 2·(3 + 3/2) = 9.
LATENT_BYTES = {
    "input_norm": 4 * 2 * 4,
    "q_kv_a_proj": 4 * 10 + 2 * 4 + 2 * 10,  # weights, input, output
    "q_kv_a_norm": 2 * 2 * (5 + 3),
    "q_b_proj": 5 * 12 + 2 * 5 + 2 * 12,
    "rope": 2 * 2 * (2 + 1) * 2,
    "latent_write": 2 * 5 + 2 * 5,
    "latent_gather": 5 * 5 + 5 * 5,
    "kv_b_proj": 3 * 14 + 5 * 3 + 5 * 14,
    "k_assemble": 5 * (2 * 4 + 2 + 2 * 6),
    "attention": (2 + 5) * 2 * (6 + 3),
    "o_proj": 6 * 4 + 2 * 6 + 2 * 4,
    "post_attention_norm": 4 * 2 * 4,
}
LATENT_FLOPS = {
    "q_kv_a_proj": 2 * 2 * 10 * 4,
    "q_b_proj": 2 * 2 * 12 * 5,
    "kv_b_proj": 2 * 5 * 14 * 3,
    "attention": 2 * 2 * (6 + 3) * 9,
    "o_proj": 2 * 2 * 4 * 6,
}
# The shared expert (3 rows) after the routed ones, and the sum reading its output too.
SHARED_BYTES = {
    "shared_gate_up_proj": 4 * 6 + 2 * 4 + 2 * 6,
    "shared_act": 3 * 2 * 3,
    "shared_down_proj": 3 * 4 + 2 * 3 + 2 * 4,
    "sum_to_tokens": 4 * 4 + 2 * 2 * 4,  # R·h routed rows, the shared rows, the tokens
}


def test_latent_attention_by_hand():
    kernels = layer_kernels(TINY, MEMORY_BOUND, [2], [3])
    attention = kernels[: len(LATENT_BYTES)]
    assert [k.name for k in attention] == list(LATENT_BYTES)
    assert {k.name: k.bytes for k in attention} == pytest.approx(LATENT_BYTES)
    flops = {k.name: k.flops for k in attention if k.flops}
    assert flops == pytest.approx(LATENT_FLOPS)
    assert [k.name for k in kernels[len(LATENT_BYTES) :]] == ["gate_up_proj", "act", "down_proj"]
    assert len(kernels) == TINY.kernels_in_layer(0) == 15


def test_shared_experts_by_hand():
    kernels = layer_kernels(TINY_MOE, MEMORY_BOUND, [2], [3], sparse=True)
    got = {k.name: k.bytes for k in kernels}
    assert {name: got[name] for name in SHARED_BYTES} == pytest.approx(SHARED_BYTES)
    assert [k.name for k in kernels[-3:]] == list(SHARED_BYTES)[:3]
    assert len(kernels) == TINY_MOE.kernels_in_layer(0) == 12 + 10 + 3
    assert DSV3.kernels_in_layer(0) == 15 and DSV3.kernels_in_layer(3) == 25


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q_lora_rank=0), "must be positive"),
        (dict(num_kv_heads=1), "a K and V per head"),
        (dict(kv_lora_rank=0), "latent attention fields without kv_lora_rank"),
        (dict(num_experts=0, experts_per_tok=0, moe_intermediate=0), "expert fields without"),
    ],
)
def test_bad_latent_fields(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY_MOE, **change)


def test_latent_layers_have_no_window():
    with pytest.raises(ValueError, match="no sliding window"):
        layer_kernels(DSV3, H200, [4], [0], window=128)


def test_deepseek_fields_the_roofline_does_not_charge_are_refused():
    with pytest.raises(ValueError, match="moe_layer_freq"):
        ModelShape.from_hf_config({**DEEPSEEK_V3_CONFIG, "moe_layer_freq": 2})
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelShape.from_hf_config({**DEEPSEEK_V3_CONFIG, "q_lora_rank": None})


def test_transformers_defaults_are_the_preset():
    """transformers' DeepseekV3Config defaults to DeepSeek-V3's dimensions: an independent
    reading of the same config.json."""
    transformers = pytest.importorskip("transformers")
    fields = transformers.DeepseekV3Config().to_dict()
    assert ModelShape.from_hf_config(fields) == dataclasses.replace(DSV3, name="")


# A DeepSeek checkpoint's config.json as the prefill reads it (no weights needed: the
# emulated device's stand-in has random ones), its vocabulary cut to keep the test short.
DEEPSEEK_BASE = {
    **DEEPSEEK_V3_CONFIG,
    "architectures": ["DeepseekV3ForCausalLM"],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "vocab_size": 512,
}


def test_the_stand_in_of_a_deepseek_checkpoint_runs_latent_attention():
    """Emulating DeepSeek-V3 with a DeepSeek base keeps latent attention at the stand-in's
    tiny width, over a latent pool of 8 + 8 elements a token and layer, 61 layers deep; the
    device is charged the preset's layers at TP 8."""
    config = host_config(config_from_hf(DEEPSEEK_BASE), "DeepSeek-V3")
    assert config.is_latent and config.num_hidden_layers == 61 and config.num_experts == 0
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (8, 8, 16)
    model = host_model(config, seed=0)
    kv = KVCache.for_model(model.config, 64)
    assert kv.latent and kv.bytes_per_slot == 61 * 16 * 4
    device = EmulatedDevice(DSV3, "h200", tp_size=8)
    fb = ForwardBatch.build([[3, 4, 5], [6, 7]], [0, 0], [[0, 1, 2], [3, 4]])
    logits = device.forward(model, fb, kv)
    assert logits.shape == (2, config.vocab_size)
    start, end, busy, collective = device.last_forward()
    assert end > start and 0 < collective < busy
