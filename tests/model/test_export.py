import dataclasses

import torch

from mpprefill.model import LlamaForCausalLM, ModelConfig, load_model
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
