"""The roofline's mixture-of-experts layers on hand-computed numbers, the MoE presets, their
shapes from config.json, and dense layers' times left as they were."""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.config import EMULATE_MODELS
from mpprefill.worker.roofline import (
    GPUS,
    KERNEL_FLOOR_S,
    KERNELS_PER_MOE_LAYER,
    PRESETS,
    GpuSpec,
    ModelShape,
    allreduce_time_s,
    experts_hit,
    experts_time_s,
    layer_parts_s,
    resolve_shape,
)

H200 = GPUS["h200"]
# Round rates, no efficiencies and no floor, so each part is FLOPs or bytes over a power of ten.
MEMORY_BOUND = GpuSpec(
    "unit",
    flops=1e12,
    bandwidth=1e9,
    gemm_efficiency=1.0,
    attention_efficiency=1.0,
    memory_efficiency=1.0,
    kernel_floor_s=0.0,
)
COMPUTE_BOUND = dataclasses.replace(MEMORY_BOUND, flops=1e9, bandwidth=1e12)
# hidden 4, dense intermediate 8, 2 heads of 2 over 1 KV head, 1 byte per element;
# 4 experts of 3 rows, top-2.
TINY = ModelShape(2, 4, 8, 2, 1, 2, 16, dtype_bytes=1, kv_dtype_bytes=1)
TINY_MOE = dataclasses.replace(TINY, num_experts=4, experts_per_tok=2, moe_intermediate=3)

# By hand, T = 2 tokens (one request of 2 new tokens, no prefix), b = 1:
#   routed rows T·k = 4; router 4·4 = 16 weights; one expert 3·4·3 = 36 weights
#   experts hit n = 4·(1 - (3/4)^4) = 700/256 = 2.734375
#   FLOPs = 2·2·16 + 2·4·36 = 64 + 288 = 352
#   bytes = 16 + 2.734375·36 (weights) + 2·4 (router logits) + 4·(4·4 + 6·3) (rows)
#         = 16 + 98.4375 + 8 + 136 = 258.4375
EXPERT_FLOPS = 352
EXPERT_BYTES = 258.4375
#   q, k, v, o: 4·(2·4 + 2·2) = 48 weights; FLOPs 2·2·48 = 192; bytes 48 + 2·10·4 = 128
#   attention: 2·(0 + 3/2) = 3 pairs, FLOPs 4·4·3 = 48; bytes 4 KV rows·4 + 2·2·4 = 32
PROJ_BYTES = 128
ATTN_BYTES = 32
PROJ_FLOPS = 192
ATTN_FLOPS = 48


def test_experts_hit_is_the_expected_distinct_count():
    assert experts_hit(4, 4) == pytest.approx(700 / 256)
    assert experts_hit(8, 1) == pytest.approx(1.0)
    assert experts_hit(8, 0) == 0.0
    assert experts_hit(128, 1 << 16) == pytest.approx(128.0)
    # Two picks of 8: the second repeats the first with probability 1/8.
    assert experts_hit(8, 2) == pytest.approx(2 - 1 / 8)


def test_experts_by_hand_memory_and_compute_bound():
    assert experts_time_s(TINY_MOE, MEMORY_BOUND, 2) == pytest.approx(EXPERT_BYTES / 1e9)
    assert experts_time_s(TINY_MOE, COMPUTE_BOUND, 2) == pytest.approx(EXPERT_FLOPS / 1e9)


def test_an_moe_layer_by_hand():
    compute, allreduce = layer_parts_s(TINY_MOE, MEMORY_BOUND, [2], [0], sparse=True)
    assert compute == pytest.approx((PROJ_BYTES + EXPERT_BYTES + ATTN_BYTES) / 1e9)
    assert allreduce == 0.0
    compute, _ = layer_parts_s(TINY_MOE, COMPUTE_BOUND, [2], [0], sparse=True)
    assert compute == pytest.approx((PROJ_FLOPS + EXPERT_FLOPS + ATTN_FLOPS) / 1e9)


def test_a_dense_layer_by_hand_and_on_an_moe_shape():
    # gate, up, down 3·4·8 = 96 more weights: P = 144; FLOPs 2·2·144 = 576;
    # bytes 144 + 2·(10·4 + 6·8) = 320
    dense, _ = layer_parts_s(TINY, MEMORY_BOUND, [2], [0])
    assert dense == pytest.approx((320 + ATTN_BYTES) / 1e9)
    assert layer_parts_s(TINY, COMPUTE_BOUND, [2], [0])[0] == pytest.approx((576 + 48) / 1e9)
    # The experts fields change nothing on a layer that is not sparse.
    assert layer_parts_s(TINY_MOE, MEMORY_BOUND, [2], [0]) == layer_parts_s(
        TINY, MEMORY_BOUND, [2], [0]
    )
    with pytest.raises(ValueError, match="no experts"):
        layer_parts_s(TINY, MEMORY_BOUND, [2], [0], sparse=True)


def test_tp_shards_each_experts_rows():
    """At TP 2 an expert of 6 rows leaves 3 on each rank: the rank's experts cost what the
    3-row shape's do by hand; the router stays whole and the output is all-reduced once
    more, as after down_proj."""
    six = dataclasses.replace(TINY_MOE, moe_intermediate=6)
    rank = six.shard(2)
    assert (rank.moe_intermediate, rank.num_experts, rank.hidden) == (3, 4, 4)
    assert experts_time_s(rank, MEMORY_BOUND, 2) == pytest.approx(EXPERT_BYTES / 1e9)
    compute, allreduce = layer_parts_s(six, MEMORY_BOUND, [2], [0], tp=2, sparse=True)
    # the rank's q, k, v, o: 4·(2·2 + 2·2) = 32 weights, bytes 32 + 80 = 112;
    # attention over 1 head: 4 KV rows·4 + 2·2·2 = 24 bytes
    assert compute == pytest.approx((112 + EXPERT_BYTES + 24) / 1e9)
    assert allreduce == 2 * allreduce_time_s(MEMORY_BOUND, 2 * 4, 2)
    with pytest.raises(ValueError, match="do not split over 2"):
        TINY_MOE.shard(2)  # 3 rows per expert


def test_a_tiny_moe_layer_pays_its_kernels_floor():
    floor = KERNELS_PER_MOE_LAYER * KERNEL_FLOOR_S
    got = layer_parts_s(PRESETS["Qwen3-30B-A3B"], H200, [1], [0], sparse=True)[0]
    assert got == floor


def test_only_the_hit_experts_weights_are_read():
    """One token of Mixtral reads about 2 of its 8 experts; a prefill chunk reads all 8,
    and its layer then costs about twice a Llama-3.1-8B layer's MLP FLOPs."""
    mixtral = PRESETS["Mixtral-8x7B"]
    one = experts_time_s(mixtral, H200, 1)
    expert_s = mixtral.expert_params * mixtral.dtype_bytes / H200.memory_bandwidth
    assert one == pytest.approx(experts_hit(8, 2) * expert_s, rel=0.01)
    chunk = sum(layer_parts_s(mixtral, H200, [8192], [0], sparse=True))
    dense = sum(layer_parts_s(mixtral, H200, [8192], [0]))
    assert 1.4 * dense < chunk < 2 * dense


@pytest.mark.parametrize(
    ("name", "dims", "experts"),
    [
        ("Qwen3-8B", (36, 4096, 12288, 32, 8, 128, 151936), (0, 0, 0)),
        ("Qwen3-32B", (64, 5120, 25600, 64, 8, 128, 151936), (0, 0, 0)),
        ("Mixtral-8x7B", (32, 4096, 14336, 32, 8, 128, 32000), (8, 2, 14336)),
        ("Qwen3-30B-A3B", (48, 2048, 6144, 32, 4, 128, 151936), (128, 8, 768)),
        ("Qwen3-235B-A22B", (94, 4096, 12288, 64, 4, 128, 151936), (128, 8, 1536)),
    ],
)
def test_new_presets(name, dims, experts):
    s = resolve_shape(name.lower())
    got = (s.num_layers, s.hidden, s.intermediate, s.num_heads, s.num_kv_heads, s.head_dim)
    assert ((*got, s.vocab), (s.num_experts, s.experts_per_tok, s.moe_intermediate)) == (
        dims,
        experts,
    )
    assert s.name == name
    assert all(s.is_sparse(i) for i in range(s.num_layers)) == bool(s.num_experts)


QWEN3_MOE = {
    "num_hidden_layers": 6,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 384,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def test_moe_fields_from_config():
    s = ModelShape.from_hf_config(QWEN3_MOE)
    assert (s.num_experts, s.experts_per_tok, s.moe_intermediate) == (8, 2, 32)
    assert [i for i in range(6) if s.is_sparse(i)] == [1, 5]  # step 2, layer 3 dense
    mixtral = {**QWEN3_MOE, "num_local_experts": 4}
    for key in ("num_experts", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"):
        del mixtral[key]
    s = ModelShape.from_hf_config(mixtral)
    assert (s.num_experts, s.moe_intermediate, s.sparse_step, s.dense_layers) == (4, 128, 1, ())
    dense = ModelShape.from_hf_config({**QWEN3_MOE, "num_experts": 0})
    assert dense.num_experts == 0 and not dense.is_sparse(1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": None}, "lacks num_experts_per_tok"),
        ({"num_experts_per_tok": 9}, "must be in 1..num_experts"),
        ({"mlp_only_layers": [6]}, "are not layers of 6"),
        ({"mlp_only_layers": "3"}, "must list ints"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive int"),
    ],
)
def test_bad_moe_fields(change, message):
    config = {k: v for k, v in {**QWEN3_MOE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(config)


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen3Moe"])
def test_shape_from_a_transformers_config(arch):
    """The field names a transformers config.json of each family carries."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{arch}Config")(num_hidden_layers=4, num_experts_per_tok=3)
    fields = config.to_dict()
    s = ModelShape.from_hf_config(fields)
    assert s.experts_per_tok == 3
    assert s.num_experts == (8 if arch == "Mixtral" else 128)
    assert s.moe_intermediate == fields.get("moe_intermediate_size", fields["intermediate_size"])
    assert all(s.is_sparse(i) for i in range(4))


def test_the_flag_lists_every_preset():
    assert tuple(PRESETS) == EMULATE_MODELS
