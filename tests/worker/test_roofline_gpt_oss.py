"""gpt-oss on the roofline: its presets, its config.json and its sliding layers' cost."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mpprefill.emulation.roofline import GPUS, layer_kernels, layer_parts_s, windowed_pairs
from mpprefill.emulation.shapes import PRESETS, ModelShape, resolve_shape

# gpt-oss-20b's config.json on the Hub, the fields the roofline reads.
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "num_hidden_layers": 24,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}


@pytest.mark.parametrize(("name", "layers", "experts"), [("20b", 24, 32), ("120b", 36, 128)])
def test_gpt_oss_presets_have_their_config_dimensions(name, layers, experts):
    s = resolve_shape(f"GPT-OSS-{name}")
    assert s.name == f"gpt-oss-{name}"
    assert (s.num_layers, s.hidden, s.num_heads, s.num_kv_heads, s.head_dim, s.vocab) == (
        layers,
        2880,
        64,
        8,
        64,
        201088,
    )
    assert (s.num_experts, s.experts_per_tok, s.moe_intermediate) == (experts, 4, 2880)
    assert all(s.is_sparse(i) for i in range(layers))
    assert s.sliding_window == 128
    assert [s.is_sliding(i) for i in range(layers)] == [i % 2 == 0 for i in range(layers)]


def test_other_presets_attend_fully():
    for s in PRESETS.values():
        if not s.name.startswith("gpt-oss"):
            assert s.sliding_window == 0 and not any(map(s.is_sliding, range(s.num_layers)))


def test_shape_from_a_gpt_oss_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    preset = dataclasses.replace(PRESETS["gpt-oss-20b"], name=tmp_path.name)
    assert resolve_shape(str(tmp_path)) == preset
    # No layer_types: gpt-oss's even layers slide, as transformers fills them in.
    bare = {k: v for k, v in GPT_OSS_20B.items() if k != "layer_types"}
    assert ModelShape.from_hf_config(bare).sliding_layers == tuple(range(0, 24, 2))


def test_only_layer_types_or_gpt_oss_make_a_config_slide():
    mistral = {**GPT_OSS_20B, "model_type": "mistral", "sliding_window": 4096}
    del mistral["layer_types"]
    assert ModelShape.from_hf_config(mistral).sliding_window == 0
    full = {**GPT_OSS_20B, "layer_types": ["full_attention"] * 24}
    assert ModelShape.from_hf_config(full).sliding_layers == ()
    no_window = {**GPT_OSS_20B, "sliding_window": None}
    assert ModelShape.from_hf_config(no_window).sliding_layers == ()
    with pytest.raises(ValueError, match="layer_types"):
        ModelShape.from_hf_config({**GPT_OSS_20B, "layer_types": ["sliding_attention"] * 3})


def test_sliding_fields_go_together():
    base = PRESETS["Llama-3.1-8B"]
    with pytest.raises(ValueError, match="together"):
        dataclasses.replace(base, sliding_window=128)
    with pytest.raises(ValueError, match="not layers"):
        dataclasses.replace(base, sliding_window=128, sliding_layers=(32,))


def test_shape_from_transformers_gpt_oss_config():
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, "GptOssConfig", None)
    if config is None:
        pytest.skip("transformers has no GptOssConfig")
    s = ModelShape.from_hf_config(config(num_hidden_layers=6).to_dict())
    assert s.sliding_layers == (0, 2, 4) and s.sliding_window == 128


def test_a_sliding_gpt_oss_layer_costs_the_windowed_attention():
    """Only the attention kernel differs between a sliding and a full gpt-oss layer: by
    hand, 4·H·d FLOPs per query-key pair and the q, KV rows and output bytes, its roofline
    max."""
    s = PRESETS["gpt-oss-20b"]
    gpu = GPUS["h200"]
    extend, prefix = [2048], [8192]
    w = s.sliding_window
    q_and_out = 2 * 2048 * s.q_width * s.dtype_bytes

    def attention(pairs: float, kv_rows: int) -> float:
        flops = 4 * s.q_width * pairs
        nbytes = kv_rows * s.kv_bytes_per_token + q_and_out
        return max(flops / gpu.attention_flops, nbytes / gpu.memory_bandwidth, 3e-6)

    full = attention(2048 * (8192 + 2049 / 2), 8192 + 2048)
    windowed = attention(windowed_pairs(2048, 8192, w), w - 1 + 2048)
    assert windowed_pairs(2048, 8192, w) == 2048 * w  # every query sees the whole window
    by_kernel = zip(
        layer_kernels(s, gpu, extend, prefix, window=w, sparse=True),
        layer_kernels(s, gpu, extend, prefix, sparse=True),
        strict=True,
    )
    assert [k.name for k, f in by_kernel if k != f] == ["attention"]
    sliding_layer = sum(layer_parts_s(s, gpu, extend, prefix, window=w, sparse=True))
    full_layer = sum(layer_parts_s(s, gpu, extend, prefix, sparse=True))
    assert full_layer - sliding_layer == pytest.approx(full - windowed)
    assert sliding_layer < 0.8 * full_layer
