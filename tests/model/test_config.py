from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.model import ModelConfig, config_from_hf

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rope_scaling": None,
}


def test_tiny_is_valid_and_frozen():
    cfg = ModelConfig.tiny()
    assert cfg.head_size == cfg.hidden_size // cfg.num_attention_heads
    assert cfg.torch_dtype == torch.float32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(num_attention_heads=8, num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(hidden_size=0), "hidden_size must be positive"),
        (dict(hidden_size=100, num_attention_heads=8), "not divisible"),
        (dict(head_dim=7), "even"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(architecture="GPT2LMHeadModel"), "GPT2LMHeadModel"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_invalid_config_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**bad)


def test_explicit_head_dim_overrides_the_division():
    cfg = ModelConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    assert (cfg.head_size, cfg.q_size, cfg.kv_size) == (64, 512, 128)


def test_from_hf_llama():
    cfg = config_from_hf(LLAMA)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_key_value_heads, cfg.head_size, cfg.rope_theta) == (4, 16, 500000.0)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.attention_out_bias


def test_from_hf_llama_attention_bias_covers_o_proj():
    cfg = config_from_hf({**LLAMA, "attention_bias": True})
    assert cfg.attention_bias and cfg.attention_out_bias


def test_from_hf_qwen2_has_qkv_bias_only():
    cfg = config_from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert cfg.attention_bias and not cfg.attention_out_bias


def test_from_hf_reads_rope_parameters_and_defaults():
    hf = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "num_key_value_heads")}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 50000.0
    assert cfg.num_key_value_heads == cfg.num_attention_heads


def test_from_hf_falls_back_to_model_type():
    hf = {**LLAMA, "model_type": "qwen2"}
    del hf["architectures"]
    assert config_from_hf(hf).architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "DeepseekV2ForCausalLM.*LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3.*low_freq_factor"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
        ({"rope_scaling": {"type": "linear"}}, "linear.*factor"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "mrope": 1}}, "mrope"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_from_hf_refuses_what_it_cannot_run(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**LLAMA, **change})


def test_from_hf_accepts_default_rope_scaling():
    cfg = config_from_hf({**LLAMA, "rope_scaling": {"rope_type": "default"}})
    assert cfg.rope_theta == 500000.0


def test_from_hf_mistral_window_applies_to_every_layer():
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"]}
    cfg = config_from_hf(mistral)  # no sliding_window key: transformers' 4096
    assert cfg.sliding_window == 4096 and all(cfg.is_sliding(i) for i in range(3))
    assert not config_from_hf({**mistral, "sliding_window": None}).has_sliding_layers
    assert not cfg.attention_bias and not cfg.attention_out_bias


def test_from_hf_qwen3_head_dim_bias_and_window():
    qwen3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"]}
    cfg = config_from_hf(qwen3)
    assert cfg.head_size == 128 and not cfg.attention_bias  # transformers' default head_dim
    assert not cfg.has_sliding_layers  # the window needs use_sliding_window
    cfg = config_from_hf(
        {**qwen3, "head_dim": 32, "attention_bias": True, "use_sliding_window": True}
    )
    assert cfg.head_size == 32 and cfg.attention_bias and cfg.attention_out_bias
    assert cfg.sliding_window == 4096 and not cfg.has_sliding_layers  # max_window_layers 28
    cfg = config_from_hf({**qwen3, "use_sliding_window": True, "max_window_layers": 1})
    assert [cfg.is_sliding(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(
    "arch, change, match",
    [
        ("MistralForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("MistralForCausalLM", {"layer_types": ["full_attention"] * 3}, "layer_types"),
        ("Qwen3ForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
        ("Qwen3ForCausalLM", {"rope_scaling": {"rope_type": "mrope", "factor": 2}}, "mrope"),
        ("Qwen2ForCausalLM", {"quantization_config": {"quant_method": "awq"}}, "quantization"),
    ],
)
def test_from_hf_refuses_fields_a_family_does_not_run(arch, change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**LLAMA, "architectures": [arch], **change})


def test_from_hf_reads_each_rope_type():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    cfg = config_from_hf({**LLAMA, "rope_scaling": llama3})
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_theta == 500000.0
    cfg = config_from_hf({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert cfg.rope_scaling.original_max_position_embeddings == 4096  # max_position_embeddings
    cfg = config_from_hf({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2}})
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("dynamic", 2)
