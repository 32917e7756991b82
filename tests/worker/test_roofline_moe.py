"""The roofline's mixture-of-experts layers on hand-computed bytes, the MoE presets and their
shapes from config.json."""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.config import EMULATE_MODELS
from mpprefill.emulation.roofline import (
    GPUS,
    KERNEL_FLOOR_S,
    GpuSpec,
    allreduce_time_s,
    experts_hit,
    experts_time_s,
    layer_kernels,
    layer_parts_s,
)
from mpprefill.emulation.shapes import (
    KERNELS_PER_LAYER,
    KERNELS_PER_MOE_LAYER,
    PRESETS,
    ModelShape,
    resolve_shape,
)

H200 = GPUS["h200"]
# FLOPs so fast, and no floor, that every kernel takes its bytes over 1 GB/s.
MEMORY_BOUND = GpuSpec("unit", flops=1e18, bandwidth=1e9, memory_efficiency=1.0, kernel_floor_s=0.0)
# hidden 4, dense intermediate 8, 2 heads of 2 over 1 KV head, 1 byte per element;
# 4 experts of 3 rows, top-2.
TINY = ModelShape(2, 4, 8, 2, 1, 2, 16, dtype_bytes=1, kv_dtype_bytes=1)
TINY_MOE = dataclasses.replace(TINY, num_experts=4, experts_per_tok=2, moe_intermediate=3)

# By hand, T = 2 tokens (one request of 2 new tokens, no prefix), b = 1: R = T·k = 4
# routed rows, experts hit n = 4·(1 - (3/4)^4) = 700/256 = 2.734375. The sparse MLP's bytes:
N_HIT = 2.734375
EXPERT_BYTES = {
    "router": 4 * 4 + 2 * 4 + 2 * 4,  # weights, input, logits
    "topk_softmax": 2 * 4 + 4 * 8,  # logits in, an id and a weight per routed row out
    "sort_by_expert": 2 * 4 * 4,
    "expert_offsets": 4 * 4,
    "gather_rows": 2 * 4 * 4,
    "experts_gate_up": N_HIT * 4 * 6 + 4 * 4 + 4 * 6,  # 105.625
    "experts_act": 3 * 4 * 3,
    "experts_down": N_HIT * 3 * 4 + 4 * 3 + 4 * 4,  # 60.8125
    "scale_rows": 2 * 4 * 4 + 4 * 4,  # rows in and out, their float32 weights
    "sum_to_tokens": 4 * 4 + 2 * 4,
}
EXPERTS = sum(EXPERT_BYTES.values())  # 426.4375
# The layer up to the MLP (q 4, kv 2, kv_row 2·2 = 4): norm 4·2·4 = 32, qkv 4·8 + 2·4 +
# 2·8 = 56, rope 2·2·6 = 24, KV write 2·2·2 + 2·4 = 16, attention 2·2·4 + 2 rows·4 = 24,
# o_proj 4·4 + 2·4 + 2·4 = 32, norm 32.
ATTN_BYTES = 216
# A dense MLP: gate_up 4·16 + 2·4 + 2·16 = 104, act 3·2·8 = 48, down 8·4 + 2·8 + 2·4 = 56.
MLP_BYTES = 208


def test_experts_hit_is_the_expected_distinct_count():
    assert experts_hit(4, 4) == pytest.approx(700 / 256)
    assert experts_hit(8, 1) == pytest.approx(1.0)
    assert experts_hit(8, 0) == 0.0
    assert experts_hit(128, 1 << 16) == pytest.approx(128.0)
    # Two picks of 8: the second repeats the first with probability 1/8.
    assert experts_hit(8, 2) == pytest.approx(2 - 1 / 8)


def test_experts_by_hand():
    kernels = layer_kernels(TINY_MOE, MEMORY_BOUND, [2], [0], sparse=True)[KERNELS_PER_LAYER - 3 :]
    assert {k.name: k.bytes for k in kernels} == pytest.approx(EXPERT_BYTES)
    assert all(k.bound == "memory" for k in kernels)
    assert experts_time_s(TINY_MOE, MEMORY_BOUND, 2) == pytest.approx(EXPERTS / 1e9)


def test_an_moe_layer_by_hand():
    compute, allreduce = layer_parts_s(TINY_MOE, MEMORY_BOUND, [2], [0], sparse=True)
    assert compute == pytest.approx((ATTN_BYTES + EXPERTS) / 1e9)
    assert allreduce == 0.0


def test_a_dense_layer_by_hand_and_on_an_moe_shape():
    dense, _ = layer_parts_s(TINY, MEMORY_BOUND, [2], [0])
    assert dense == pytest.approx((ATTN_BYTES + MLP_BYTES) / 1e9)
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
    assert experts_time_s(rank, MEMORY_BOUND, 2) == pytest.approx(EXPERTS / 1e9)
    compute, allreduce = layer_parts_s(six, MEMORY_BOUND, [2], [0], tp=2, sparse=True)
    # the rank's 1 head (q 2, kv 2): norm 32, qkv 4·6 + 2·4 + 2·6 = 44, rope 2·2·4 = 16,
    # KV write 16, attention 2·2·2 + 2·4 = 16, o_proj 2·4 + 2·2 + 2·4 = 20, norm 32
    assert compute == pytest.approx((176 + EXPERTS) / 1e9)
    assert allreduce == 2 * allreduce_time_s(MEMORY_BOUND, 2 * 4, 2)
    with pytest.raises(ValueError, match="do not split over 2"):
        TINY_MOE.shard(2)  # 3 rows per expert


def test_a_tiny_moe_layer_pays_its_kernels_floor():
    """One token of Qwen3-30B-A3B: 17 kernels, each at least the floor; the routing
    bookkeeping and the elementwise kernels are nothing but the floor."""
    kernels = layer_kernels(PRESETS["Qwen3-30B-A3B"], H200, [1], [0], sparse=True)
    assert len(kernels) == KERNELS_PER_MOE_LAYER
    assert all(k.seconds >= KERNEL_FLOOR_S for k in kernels)
    small = ("topk_softmax", "sort_by_expert", "expert_offsets", "gather_rows", "experts_act")
    assert all(k.bound == "floor" for k in kernels if k.name in small)


def test_only_the_hit_experts_weights_are_read():
    """One token of Mixtral reads about 2 of its 8 experts through the grouped GEMMs; a
    prefill chunk reads all 8, and its layer then costs well more than a dense one's."""
    mixtral = PRESETS["Mixtral-8x7B"]
    kernels = layer_kernels(mixtral, H200, [1], [0], sparse=True)
    grouped = [k for k in kernels if k.name in ("experts_gate_up", "experts_down")]
    assert {k.bound for k in grouped} == {"memory"}
    expert_s = mixtral.expert_params * mixtral.dtype_bytes / H200.memory_bandwidth
    assert sum(k.seconds for k in grouped) == pytest.approx(experts_hit(8, 2) * expert_s, rel=0.01)
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
