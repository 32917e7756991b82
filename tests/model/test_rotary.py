"""The rotary tables of every scaling type against transformers' own rope functions: the
inverse frequencies, the cos/sin factor (yarn's attention scaling) and the cos/sin a
transformers rotary module hands its attention."""

from __future__ import annotations

import pytest
import torch

from mpprefill.model import config_from_hf
from mpprefill.model.layers.rotary import Rotary, inverse_frequencies

transformers = pytest.importorskip("transformers", reason="the oracle is transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

DIMS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas-untruncated": {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-mscales": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.25,
    },
}


def hf_config(scaling: dict, theta: float = 50000.0, **changes):
    return transformers.LlamaConfig(
        **{**DIMS, **changes}, rope_parameters={**scaling, "rope_theta": theta}
    )


def hf_rope(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).inv_freq, 1.0
    return rope_utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)


def ours(config):
    return config_from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_and_factor_equal_transformers(name):
    config = hf_config(SCALINGS[name])
    want, want_factor = hf_rope(config)
    got, factor = inverse_frequencies(ours(config))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("seq_len", [100, 256, 257, 1000, 4097])
def test_dynamic_frequencies_follow_the_sequence_length(seq_len):
    config = hf_config(SCALINGS["dynamic"])
    want, _ = hf_rope(config, seq_len)
    got, _ = inverse_frequencies(ours(config), seq_len)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_explicit_head_dim_sets_the_frequencies():
    config = hf_config(SCALINGS["yarn"], head_dim=32)
    got, _ = inverse_frequencies(ours(config))
    assert got.shape == (16,)
    torch.testing.assert_close(got, hf_rope(config)[0].float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn", "yarn-mscales"])
def test_cos_sin_equal_the_transformers_rotary_module(name):
    """Positions 0 .. 299 (past max_position_embeddings, so the table grows once)."""
    config = hf_config(SCALINGS[name])
    module = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(300)
    want_cos, want_sin = module(torch.zeros(1, dtype=torch.float32), positions[None])
    rotary = Rotary(ours(config), "cpu")
    cos, sin = rotary.at(positions, 300, torch.float32)
    half = config.head_dim // 2
    torch.testing.assert_close(cos[:, 0], want_cos[0, :, :half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], want_sin[0, :, :half], rtol=1e-6, atol=1e-6)
    assert rotary.cos.dtype == torch.float32 and rotary.cos.shape[0] >= 300


def test_dynamic_table_comes_from_the_host_length_and_is_kept():
    config = ours(hf_config(SCALINGS["dynamic"]))
    rotary = Rotary(config, "cpu")
    short = rotary.tables(200)
    assert short[0] is rotary.cos  # within max_position_embeddings: the default table
    long = rotary.tables(1000)
    assert long[0].shape[0] == 1000 and rotary.tables(1000)[0] is long[0]
    want, _ = inverse_frequencies(config, 1000)
    torch.testing.assert_close(long[0][999], (999 * want).cos())
    assert not torch.equal(long[0][:200], short[0][:200])


def test_top_level_original_max_position_embeddings_wins():
    hf = {
        **DIMS,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 32,
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
    }
    cfg = config_from_hf(hf)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling.original_max_position_embeddings == 32
