"""Write a model as a Hugging Face style directory (config.json + model.safetensors)."""

from __future__ import annotations

import dataclasses
import json
import os

from mpprefill.model.config import ModelConfig
from mpprefill.model.families import build_model, family
from mpprefill.model.hf_config import require
from mpprefill.model.loader import hf_state_dict


def hf_config(config: ModelConfig) -> dict:
    require(config.architecture != "GptOssForCausalLM", "writing a gpt-oss checkpoint is not built")
    d = dataclasses.asdict(config)
    for key in ("attention_sinks", "expert_bias", "swiglu_limit", "swiglu_alpha"):
        del d[key]  # gpt-oss's, whose checkpoints this does not write
    scaling = d.pop("rope_scaling")
    out = {
        "architectures": [d.pop("architecture")],
        "model_type": family(config.architecture).model_type,
        "hidden_act": "silu",
        "torch_dtype": d.pop("dtype"),
        "head_dim": config.head_size,
        **{k: v for k, v in d.items() if k not in ("head_dim", "attention_out_bias")},
    }
    if scaling is not None:
        yarn = scaling["rope_type"] == "yarn"
        out["rope_scaling"] = {
            k: v for k, v in scaling.items() if v is not None and (yarn or k != "truncate")
        }
    if config.sliding_window is not None and config.architecture != "MistralForCausalLM":
        out["use_sliding_window"] = True  # the Qwen families read the window only with it
    if config.architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        del out["layer_types"]  # every layer of a Mistral slides, or none
    return out | _experts(out, config)


def _experts(out: dict, config: ModelConfig) -> dict:
    """The mixture-of-experts fields under the names the family reads (none when dense)."""
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    for key in (*moe, "dense_mlp_layers"):
        del out[key]
    if config.num_experts == 0:
        return {}
    fields = {k: getattr(config, k) for k in moe}
    if config.architecture == "MixtralForCausalLM":
        fields["num_local_experts"] = fields.pop("num_experts")
        return fields
    return fields | {"mlp_only_layers": list(config.dense_mlp_layers)}


def save_random_model(config: ModelConfig, path: str, seed: int = 0) -> str:
    """A seeded random model of `config`, saved so that `load_model(path)` reads it back."""
    from safetensors.torch import save_file

    model = build_model(config)
    model.init_random_weights(seed)
    tensors = hf_state_dict(model)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
