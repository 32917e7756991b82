"""Write a model as a Hugging Face style directory (config.json + model.safetensors)."""

from __future__ import annotations

import dataclasses
import json
import os

from mpprefill.model.config import ModelConfig
from mpprefill.model.llama import LlamaForCausalLM
from mpprefill.model.loader import hf_state_dict


def hf_config(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    return {
        "architectures": [d.pop("architecture")],
        "model_type": "llama" if config.architecture == "LlamaForCausalLM" else "qwen2",
        "hidden_act": "silu",
        "torch_dtype": d.pop("dtype"),
        "head_dim": config.head_size,
        **{k: v for k, v in d.items() if k not in ("head_dim", "attention_out_bias")},
    }


def save_random_model(config: ModelConfig, path: str, seed: int = 0) -> str:
    """A seeded random model of `config`, saved so that `load_model(path)` reads it back."""
    from safetensors.torch import save_file

    model = LlamaForCausalLM(config)
    model.init_random_weights(seed)
    tensors = hf_state_dict(model)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
