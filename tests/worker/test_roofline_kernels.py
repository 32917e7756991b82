"""The roofline kernel by kernel: one dense and one sparse layer worked out by hand on round
rates, the GEMM efficiency curve at hand-computed points, and the presets' kernel lists."""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.emulation.roofline import (
    GEMM_TILES,
    GPUS,
    GpuSpec,
    Kernel,
    experts_hit,
    gemm_efficiency,
    head_kernels,
    head_parts_s,
    layer_kernels,
    layer_parts_s,
)
from mpprefill.emulation.shapes import (
    KERNELS_PER_HEAD,
    KERNELS_PER_LAYER,
    KERNELS_PER_MOE_LAYER,
    PRESETS,
    ModelShape,
)

# Round rates: 1 TFLOP/s, 100 GB/s, a 2 µs floor, 4 SMs; GEMMs top out at peak, attention
# at half of it, streams at the full bandwidth.
UNIT = GpuSpec(
    "unit",
    flops=1e12,
    bandwidth=1e11,
    peak_gemm_efficiency=1.0,
    attention_efficiency=0.5,
    memory_efficiency=1.0,
    kernel_floor_s=2e-6,
    num_sms=4,
)
# hidden 256, intermediate 512, 4 heads of 32 over 2 KV heads (q 128, kv 64), 2 bytes.
SMALL = ModelShape(1, 256, 512, 4, 2, 32, 1024)
# The same with 4 experts of 128 rows, top-2.
SMALL_MOE = dataclasses.replace(SMALL, num_experts=4, experts_per_tok=2, moe_intermediate=128)
# Two requests of 128 new tokens, the second after 256 cached: T = 256.
EXTEND, PREFIX = [128, 128], [0, 256]

# By hand, T = 256, h = 256, q = 128, kv = 64, I = 512, b = 2, kv_row = 2·64·2 = 256.
# GEMM efficiencies on 4 SMs (tiles 128x256 at 1.0, 128x128 at 0.9, 64x128 at 0.7):
#   qkv 256 x 256 x 256: 128x256 → 2 tiles, util 0.5; 128x128 → 4 tiles, one wave, 0.9;
#     64x128 → 8 tiles, two waves, 0.7. Best 0.9, times K/(K+128) = 256/384: 0.6
#   o_proj 256 x 256 x 128: 0.9 · 128/256 = 0.45
#   gate_up 256 x 1024 x 256: 128x256 → 8 tiles, two full waves, 1.0 · 256/384 = 2/3
#   down 256 x 256 x 512: 0.9 · 512/640 = 0.72
# Attention pairs: 128·(0 + 129/2) + 128·(256 + 129/2) = 8256 + 41024 = 49280;
# KV rows read 128 + 384 = 512.
DENSE = [
    # name, FLOPs, bytes, seconds, bound
    ("input_norm", 0, 4 * 256 * 256 * 2, 524288 / 1e11, "memory"),
    (
        "qkv_proj",
        2 * 256 * 256 * 256,
        (256 * 256 + 256 * 256 + 256 * 256) * 2,
        33554432 / (1e12 * 0.6),
        "compute",
    ),
    ("rope", 0, 2 * 256 * (128 + 64) * 2, 2e-6, "floor"),  # 196608 B: 1.97 µs
    ("kv_write", 0, 2 * 256 * 64 * 2 + 256 * 256, 2e-6, "floor"),  # 131072 B: 1.31 µs
    (
        "attention",
        4 * 128 * 49280,
        2 * 256 * 128 * 2 + 512 * 256,
        25231360 / (1e12 * 0.5),
        "compute",
    ),
    (
        "o_proj",
        2 * 256 * 256 * 128,
        (128 * 256 + 256 * 128 + 256 * 256) * 2,
        16777216 / (1e12 * 0.45),
        "compute",
    ),
    ("post_attention_norm", 0, 4 * 256 * 256 * 2, 524288 / 1e11, "memory"),
    (
        "gate_up_proj",
        2 * 256 * 1024 * 256,
        (256 * 1024 + 256 * 256 + 256 * 1024) * 2,
        134217728 / (1e12 * 2 / 3),
        "compute",
    ),
    ("act", 0, 3 * 256 * 512 * 2, 786432 / 1e11, "memory"),
    (
        "down_proj",
        2 * 256 * 256 * 512,
        (512 * 256 + 256 * 512 + 256 * 256) * 2,
        67108864 / (1e12 * 0.72),
        "compute",
    ),
]

# The sparse MLP by hand: E = 4, k = 2, I_e = 128, R = 512 routed rows, all 4 experts hit
# (4·(1 - (3/4)^512) rounds to 4.0), 128 rows each.
#   router 256 x 4 x 256: 64x128 → 4 tiles, one wave, 0.7 · 1024/32768 = 0.021875
#     (128x128: 0.9/64, 128x256: 1/128), times 256/384
#   grouped gate_up, 4 x (128 x 256 x 256): 4 tiles of 128x256, one full wave: 256/384
#   grouped down, 4 x (128 x 256 x 128): one full wave: 128/256
SPARSE_MLP = [
    (
        "router",
        2 * 256 * 4 * 256,
        (256 * 4 + 256 * 256 + 256 * 4) * 2,
        524288 / (1e12 * 0.021875 * 2 / 3),
        "compute",
    ),
    ("topk_softmax", 0, 256 * 4 * 2 + 512 * 8, 2e-6, "floor"),
    ("sort_by_expert", 0, 2 * 512 * 4, 2e-6, "floor"),
    ("expert_offsets", 0, 4 * 4, 2e-6, "floor"),
    ("gather_rows", 0, 2 * 512 * 256 * 2, 524288 / 1e11, "memory"),
    (
        "experts_gate_up",
        2 * 512 * 256 * 256,
        4 * 256 * 256 * 2 + 512 * 256 * 2 + 512 * 256 * 2,
        67108864 / (1e12 * 2 / 3),
        "compute",
    ),
    ("experts_act", 0, 3 * 512 * 128 * 2, 393216 / 1e11, "memory"),
    (
        "experts_down",
        2 * 512 * 256 * 128,
        4 * 128 * 256 * 2 + 512 * 128 * 2 + 512 * 256 * 2,
        33554432 / (1e12 * 0.5),
        "compute",
    ),
    ("scale_rows", 0, 2 * 512 * 256 * 2 + 512 * 4, 526336 / 1e11, "memory"),
    ("sum_to_tokens", 0, 512 * 256 * 2 + 256 * 256 * 2, 393216 / 1e11, "memory"),
]


def _check(got: list[Kernel], want: list[tuple]) -> None:
    assert [k.name for k in got] == [w[0] for w in want]
    for k, (name, flops, nbytes, seconds, bound) in zip(got, want, strict=True):
        assert (k.flops, k.bytes) == (pytest.approx(flops), pytest.approx(nbytes)), name
        assert k.seconds == pytest.approx(seconds), name
        assert k.bound == bound, name


def test_a_dense_layer_by_hand():
    kernels = layer_kernels(SMALL, UNIT, EXTEND, PREFIX)
    _check(kernels, DENSE)
    assert len(kernels) == KERNELS_PER_LAYER
    compute, allreduce = layer_parts_s(SMALL, UNIT, EXTEND, PREFIX)
    assert compute == pytest.approx(sum(w[3] for w in DENSE))
    assert allreduce == 0.0


def test_a_sparse_layer_by_hand():
    assert experts_hit(4, 512) == pytest.approx(4.0)
    kernels = layer_kernels(SMALL_MOE, UNIT, EXTEND, PREFIX, sparse=True)
    _check(kernels, DENSE[:7] + SPARSE_MLP)
    assert len(kernels) == KERNELS_PER_MOE_LAYER
    compute, _ = layer_parts_s(SMALL_MOE, UNIT, EXTEND, PREFIX, sparse=True)
    assert compute == pytest.approx(sum(w[3] for w in DENSE[:7] + SPARSE_MLP))


def test_a_memory_bound_layer_is_its_bytes_over_the_bandwidth():
    """At 1 GB/s every kernel of the same layer is memory-bound: the layer is its bytes."""
    slow = dataclasses.replace(UNIT, bandwidth=1e9)
    kernels = layer_kernels(SMALL, slow, EXTEND, PREFIX)
    assert {k.bound for k in kernels} == {"memory"}
    total = sum(w[2] for w in DENSE)
    assert layer_parts_s(SMALL, slow, EXTEND, PREFIX)[0] == pytest.approx(total / 1e9)


def test_a_compute_bound_layer_is_its_flops_over_the_rates():
    """At 1 PB/s the streams take nothing, below the floor; the GEMMs and attention take
    their FLOPs at the curve's rates."""
    fast = dataclasses.replace(UNIT, bandwidth=1e15)
    kernels = layer_kernels(SMALL, fast, EXTEND, PREFIX)
    compute = [w[3] for w in DENSE if w[4] == "compute"]
    assert [k.bound for k in kernels].count("floor") == len(DENSE) - len(compute)
    want = sum(compute) + (len(DENSE) - len(compute)) * 2e-6
    assert layer_parts_s(SMALL, fast, EXTEND, PREFIX)[0] == pytest.approx(want)


def test_a_floor_bound_layer_is_its_kernel_count_times_the_floor():
    slow_launch = dataclasses.replace(UNIT, kernel_floor_s=1e-3)
    kernels = layer_kernels(SMALL, slow_launch, EXTEND, PREFIX)
    assert {k.bound for k in kernels} == {"floor"}
    assert layer_parts_s(SMALL, slow_launch, EXTEND, PREFIX)[0] == pytest.approx(10e-3)
    sparse = layer_parts_s(SMALL_MOE, slow_launch, EXTEND, PREFIX, sparse=True)[0]
    assert sparse == pytest.approx(17e-3)


def test_the_head_by_hand():
    """3 requests: gather of their last rows and the final norm, 2·3·256·2 bytes each, and
    a 3 x 1024 x 256 LM head writing float32 logits. Its GEMM: 64x128 → 8 tiles in two
    waves, 0.7 · 3·1024 / (2·4·64·128) = 0.0328125, times 256/384."""
    got = head_kernels(SMALL, UNIT, 3)
    lm_flops, lm_bytes = 2 * 3 * 1024 * 256, 1024 * 256 * 2 + 3 * 256 * 2 + 3 * 1024 * 4
    want = [
        ("gather_last", 0, 2 * 3 * 256 * 2, 2e-6, "floor"),
        ("final_norm", 0, 2 * 3 * 256 * 2, 2e-6, "floor"),
        ("lm_head", lm_flops, lm_bytes, lm_flops / (1e12 * 0.0328125 * 2 / 3), "compute"),
    ]
    _check(got, want)
    assert len(got) == KERNELS_PER_HEAD
    assert head_parts_s(SMALL, UNIT, 3) == (pytest.approx(sum(w[3] for w in want)), 0.0)


def test_windowed_attention_by_hand():
    """Window 64: the first request's j-th token sees min(j + 1, 64) keys, 64·65/2 + 64·64
    pairs; the second's all see 64, and 63 + 128 KV rows are read for it, 128 for the
    first."""
    got = layer_kernels(SMALL, UNIT, EXTEND, PREFIX, window=64)[4]
    pairs = 64 * 65 // 2 + 64 * 64 + 128 * 64
    assert got.name == "attention"
    assert got.flops == 4 * 128 * pairs
    assert got.bytes == 2 * 256 * 128 * 2 + (128 + 63 + 128) * 256


# A Hopper-sized GPU at peak 0.8 for the curve's points.
SM132 = dataclasses.replace(UNIT, peak_gemm_efficiency=0.8, num_sms=132)
BIG_TILE = GEMM_TILES[:1]


def test_wave_quantization_halves_the_rate_of_one_tile_more():
    """132 tiles of 128x256 fill one wave of 132 SMs; 133 take two, the second nearly
    empty: 133/264 of the rate."""
    k = 4096
    full = gemm_efficiency(SM132, 128 * 132, 256, k, tiles=BIG_TILE)
    assert full == pytest.approx(0.8 * k / (k + 128))
    over = gemm_efficiency(SM132, 128 * 133, 256, k, tiles=BIG_TILE)
    assert over == pytest.approx(full * 133 / 264)
    assert 0.49 < over / full < 0.51
    # With the smaller tiles to choose from: 128x128 makes 266 tiles in 3 waves,
    # 0.9·266/396; 64x128 makes 532 in 5 waves, 0.7·532/660. The first wins.
    best = gemm_efficiency(SM132, 128 * 133, 256, k)
    assert best == pytest.approx(full * 0.9 * 266 / 396)
    assert gemm_efficiency(SM132, 128 * 132, 256, k) == pytest.approx(full)


def test_tile_quantization_and_the_k_ramp():
    # One row more than a tile pads a whole second tile row: 129 x 256 on 132 SMs is two
    # 128x256 tiles (0.9 · 129·256 / (132·128·128) with 128x128 is worse), one wave.
    assert gemm_efficiency(SM132, 129, 256, 4096, tiles=BIG_TILE) == pytest.approx(
        0.8 * 129 * 256 / (132 * 128 * 256) * 4096 / 4224
    )
    # Small K loses K/(K + 128): half at K = 128, 32/33 at K = 4096.
    big = 128 * 132
    assert gemm_efficiency(SM132, big, 256, 128) == pytest.approx(0.8 * 0.5)
    assert gemm_efficiency(SM132, big, 256, 4096) == pytest.approx(0.8 * 32 / 33)


def test_grouped_gemms_share_the_waves():
    """4 groups of 128 x 256 on 4 SMs are one full wave of 128x256 tiles; one alone fills
    the 4 SMs only with 64x128 tiles, at 0.7 (times 128/256 for K = 128 in both)."""
    assert gemm_efficiency(UNIT, 128, 256, 128, groups=4) == pytest.approx(0.5)
    assert gemm_efficiency(UNIT, 128, 256, 128) == pytest.approx(0.7 * 0.5)


def test_split_k_fills_idle_sms_with_slices_of_k():
    """One 128x256 tile on 4 SMs: cut into 4 slices of K/4, the 4 tiles fill the wave, and
    each slice pays the ramp on K/4 = 256: 4 x 1/4 of the SMs used, times 256/384."""
    assert gemm_efficiency(UNIT, 128, 256, 1024, tiles=BIG_TILE) == pytest.approx(
        0.25 * 1024 / 1152
    )
    assert gemm_efficiency(UNIT, 128, 256, 1024, tiles=BIG_TILE, split=4) == pytest.approx(
        256 / 384
    )


def test_a_gemm_of_one_row_is_charged_its_weights_read_not_a_wave():
    """Qwen2.5-0.5B's down_proj for one token (1 x 896 x 4864): split 8 ways along K (slices
    of 608), its 7 tiles of 64x128 make 56, one wave, so it is bound by its weights' read
    and the partial sums (or the floor), not by a wave of tiles over all of K."""
    gpu = GPUS["h200"]
    down = layer_kernels(PRESETS["Qwen2.5-0.5B"], gpu, [1], [0])[-1]
    weights = 896 * 4864 * 2
    partials = 2 * 8 * 896 * 4
    read = (weights + 4864 * 2 + 896 * 2 + partials) / gpu.memory_bandwidth
    eff = 0.8 * 0.7 * 8 * 896 / (132 * 64 * 128) * 608 / (608 + 128)
    compute = 2 * 896 * 4864 / (989e12 * eff)
    assert down.seconds == pytest.approx(max(read, compute, gpu.kernel_floor_s))
    unsplit = 2 * 64 * 128 * (4864 + 128) / (989e12 / 132 * 0.8 * 0.7)
    assert down.seconds < unsplit / 3


def test_the_efficiency_never_exceeds_the_peak():
    for m in (1, 7, 64, 200, 1000, 8192, 100_000):
        for n in (4, 128, 896, 1152, 4096, 151936):
            eff = gemm_efficiency(GPUS["h200"], m, n, 4096)
            assert 0 < eff <= GPUS["h200"].peak_gemm_efficiency


@pytest.mark.parametrize("shape", list(PRESETS.values()), ids=list(PRESETS))
def test_every_preset_launches_the_counted_kernels(shape):
    gpu = GPUS["h200"]
    dense = layer_kernels(shape, gpu, [300, 1], [0, 500])
    assert len(dense) == len({k.name for k in dense})
    if shape.is_latent:  # DeepSeek-V3: latent attention, dense first layers, shared experts
        assert len(dense) == shape.kernels_in_layer(0) == 15
    else:
        assert len(dense) == KERNELS_PER_LAYER
    if shape.num_experts:
        sparse = layer_kernels(shape, gpu, [300, 1], [0, 500], sparse=True)
        first = next(i for i in range(shape.num_layers) if shape.is_sparse(i))
        assert len(sparse) == shape.kernels_in_layer(first) == len({k.name for k in sparse})
        if not shape.shared_intermediate and not shape.is_latent:
            assert len(sparse) == KERNELS_PER_MOE_LAYER
    assert len(head_kernels(shape, gpu, 2)) == KERNELS_PER_HEAD
    for k in dense:
        memory = max(k.bytes / gpu.memory_bandwidth, gpu.kernel_floor_s)
        assert k.seconds >= memory
        assert (k.seconds == memory) == (k.bound != "compute")


def test_a_rank_runs_its_shards_kernels():
    shape = PRESETS["Llama-3.1-70B"]
    for tp in (2, 8):
        rank = layer_kernels(shape, GPUS["h200"], [4096], [1024], tp)
        assert rank == layer_kernels(shape.shard(tp), GPUS["h200"], [4096], [1024])


def test_gpu_sms():
    assert (GPUS["h100"].num_sms, GPUS["h200"].num_sms, GPUS["b200"].num_sms) == (132, 132, 148)
    with pytest.raises(ValueError, match="num_sms"):
        GpuSpec("x", 1e12, 1e12, num_sms=0)


def _old_layer_s(s: ModelShape, tokens: int) -> float:
    """The layer as the roofline charged it before kernels were charged one by one: linear
    weights at a flat 0.7 of peak, attention at 0.5, one max each, then the 10-kernel floor."""
    flops, bandwidth = 989e12, 4.8e12 * 0.8
    linear_flops = 2 * tokens * s.params_per_layer
    linear_bytes = (s.params_per_layer + tokens * (10 * s.hidden + 6 * s.intermediate)) * 2
    linear = max(linear_flops / (flops * 0.7), linear_bytes / bandwidth)
    attn_flops = 4 * s.q_width * tokens * (tokens + 1) / 2
    attn_bytes = 2 * tokens * s.kv_bytes_per_token + 2 * tokens * s.q_width * 2
    attention = max(attn_flops / (flops * 0.5), attn_bytes / bandwidth)
    return max(linear + attention, 10 * 3e-6)


def test_a_small_model_costs_more_than_the_flat_roofline_said():
    """Qwen2.5-0.5B's narrow GEMMs (896 wide) lose to tile and wave quantization and its
    K ramp, and its streams each pay their own bytes: at 8192 tokens its layer costs more
    than the one-max-per-part model charged."""
    shape = PRESETS["Qwen2.5-0.5B"]
    old = _old_layer_s(shape, 8192)
    assert old == pytest.approx(596.07e-6, rel=1e-5)  # what the old roofline charged
    assert layer_parts_s(shape, GPUS["h200"], [8192], [0])[0] > 1.1 * old
