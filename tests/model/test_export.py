import dataclasses

import pytest
import torch

from mpprefill.model import LlamaForCausalLM, ModelConfig, build_model, load_model
from mpprefill.model.config import RopeScaling
from mpprefill.model.export import save_random_model


def test_saved_random_model_loads_back_identical(tmp_path):
    cfg = dataclasses.replace(
        ModelConfig.tiny(),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=20000.0,
    )
    save_random_model(cfg, str(tmp_path), seed=3)
    ref = LlamaForCausalLM(cfg)
    ref.init_random_weights(3)
    loaded = load_model(str(tmp_path))
    assert loaded.config == dataclasses.replace(cfg, head_dim=cfg.head_size)
    for (name, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "changes",
    [
        dict(
            architecture="MistralForCausalLM",
            sliding_window=8,
            layer_types=("sliding_attention",) * 2,
        ),
        dict(
            architecture="Qwen3ForCausalLM",
            head_dim=32,
            sliding_window=8,
            layer_types=("full_attention", "sliding_attention"),
            rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=64),
        ),
        dict(
            rope_scaling=RopeScaling("llama3", 8.0, 64, low_freq_factor=1.0, high_freq_factor=4.0)
        ),
        dict(
            architecture="MixtralForCausalLM",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
        ),
        dict(
            architecture="Qwen3MoeForCausalLM",
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            dense_mlp_layers=(0,),
        ),
    ],
    ids=["mistral", "qwen3-yarn", "llama3", "mixtral", "qwen3-moe"],
)
def test_each_family_saves_and_loads_back(tmp_path, changes):
    cfg = dataclasses.replace(
        ModelConfig.tiny(),
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        **changes,
    )
    save_random_model(cfg, str(tmp_path), seed=5)
    ref = build_model(cfg)
    ref.init_random_weights(5)
    loaded = load_model(str(tmp_path))
    assert type(loaded) is type(ref)
    assert loaded.config == dataclasses.replace(cfg, head_dim=cfg.head_size)
    for (name, p), (_, q) in zip(ref.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name
