"""gpt-oss (`GptOssForCausalLM`): attention with biases on q, k, v and o (`attention_bias`,
on by default), an explicit `head_dim`, a learned sink logit per query head, and layers
alternating sliding and full attention (`layer_types`; absent: even layers slide) over
`sliding_window` positions; YaRN rope (theta 150,000 where config.json names none, as
transformers defaults it). Every layer's MLP is a mixture of `num_local_experts` experts of
`intermediate_size` rows with biases, routed by a router with a bias: softmax over each
token's `num_experts_per_tok` largest logits (the renormalised top-k of the full softmax,
the same weights), then the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`)."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, require
from mpprefill.model.layers.moe import ExpertNames

# transformers' defaults where config.json names none
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULTS = {
    "head_dim": 64,
    "sliding_window": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
}


class GptOssForCausalLM(CausalLM):
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    expert_names = ExpertNames(
        block="mlp.", router="router", gate="gate_up_proj", up="gate_up_proj", stacked=True
    )

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        hf = {"rope_theta": DEFAULT_THETA, **DEFAULTS, **hf}
        if not (hf.get("rope_scaling") or hf.get("rope_parameters")):
            hf["rope_parameters"] = DEFAULT_ROPE
        for key in ("num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"):
            require(hf[key] is not None, f"config.json's {key} is null")
        fields = dense_fields(hf)
        layers = fields["num_hidden_layers"]
        types = tuple(hf.get("layer_types") or _alternating(layers))
        window = hf.get("sliding_window")
        require(
            window is not None or "sliding_attention" not in types,
            "config.json's layer_types name sliding layers but sliding_window is null",
        )
        bias = bool(hf.get("attention_bias", True))
        return ModelConfig(
            **fields,
            attention_bias=bias,
            attention_out_bias=bias,
            attention_sinks=True,
            architecture=cls.architecture,
            sliding_window=None if window is None else int(window),
            layer_types=types if window is not None else None,
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            expert_bias=True,
            swiglu_limit=float(hf["swiglu_limit"]),
            swiglu_alpha=float(hf["swiglu_alpha"]),
        )


def _alternating(layers: int) -> tuple[str, ...]:
    """transformers' default: layer i slides when i is even."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
