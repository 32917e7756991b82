"""The mixture-of-experts layer against a loop over tokens, and how the MoE families read
their configs. Their checkpoints through the engine against transformers run with the other
families' (`test_families.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.model import ModelConfig
from mpprefill.model.families import config_from_hf
from mpprefill.model.layers.moe import SparseMoE
from mpprefill.model.loader import read_config
from tests.model.test_families import DIMS, MOE, hf_model
from tests.model.test_hf_oracle import save


def layer(experts: int = 8, k: int = 2, norm: bool = True, grouped: bool = True) -> SparseMoE:
    config = dataclasses.replace(
        ModelConfig.tiny(),
        hidden_size=64,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=48,
        norm_topk_prob=norm,
    )
    m = SparseMoE(config, grouped=grouped)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return m


def per_token(m: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its experts one at a time."""
    probs = torch.softmax(x @ m.router.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights, experts = probs[t].topk(m.top_k)
        if m.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            gate, up = (m.w13[e] @ x[t]).chunk(2)
            out[t] += w * (m.w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dense"])
@pytest.mark.parametrize(("experts", "k", "norm"), [(8, 2, True), (4, 1, False), (6, 6, False)])
def test_the_layer_matches_a_loop_over_tokens(grouped, experts, k, norm):
    m = layer(experts, k, norm, grouped)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m(x), per_token(m, x), rtol=1e-5, atol=1e-5)


def test_experts_no_token_picked_and_a_single_token():
    m = layer(8, 2)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[3, 0] = 5.0  # every token with x[0] > 0 goes to expert 3 first
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).abs()
        torch.testing.assert_close(m(x), per_token(m, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(x[:1]), per_token(m, x[:1]), rtol=1e-5, atol=1e-5)


def test_qwen3_moe_layers_as_transformers_reads_them(tmp_path):
    changes = dict(num_experts=4, moe_intermediate_size=32, num_hidden_layers=4, **MOE)
    model = hf_model("Qwen3Moe", decoder_sparse_step=2, mlp_only_layers=[3], **changes)
    config = read_config(save(model, tmp_path))
    assert config.num_experts == 4 and config.dense_mlp_layers == (0, 2, 3)
    assert [config.is_moe(i) for i in range(4)] == [False, True, False, False]
    assert not config.norm_topk_prob and config.head_size == 16


def test_mixtral_reads_its_experts_and_theta():
    hf = {**DIMS, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, **MOE}
    config = config_from_hf(hf)
    assert (config.num_experts, config.moe_intermediate_size) == (8, DIMS["intermediate_size"])
    assert config.norm_topk_prob and config.rope_theta == 1e6
    assert config.is_moe(0) and config.sliding_window is None


@pytest.mark.parametrize(
    ("arch", "changes", "match"),
    [
        ("MixtralForCausalLM", {"attention_bias": True}, "attention_bias"),
        ("MixtralForCausalLM", {"num_local_experts": None}, "num_local_experts"),
        ("MixtralForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("Qwen3MoeForCausalLM", {"shared_expert_intermediate_size": 64}, "shared_expert"),
        ("Qwen3MoeForCausalLM", {"layer_types": ["full_attention"] * 3}, "layer_types"),
        ("Qwen3MoeForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_moe_fields_are_refused_by_name(arch, changes, match):
    hf = {**DIMS, "architectures": [arch], "num_local_experts": 8, **MOE, **changes}
    with pytest.raises(ValueError, match=match):
        config_from_hf(hf)
