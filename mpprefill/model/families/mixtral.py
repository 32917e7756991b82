"""Mixtral (`MixtralForCausalLM`): Mistral's attention (no biases, `sliding_window` on every
layer where config.json names one; none by default) and on every layer a mixture of
`num_local_experts` experts of `intermediate_size` rows, each token routed to
`num_experts_per_tok` of them, their weights renormalised. Rope theta is 1e6 where
config.json names none, as transformers defaults it."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, refuse, require
from mpprefill.model.layers.moe import ExpertNames

DEFAULT_THETA = 1e6


class MixtralForCausalLM(CausalLM):
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    expert_names = ExpertNames(block="block_sparse_moe.", gate="w1", up="w3", down="w2")

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        # NOTE: transformers' Mixtral has no attention biases and reads no layer_types.
        refuse(hf, "attention_bias", (None, False), " by MixtralForCausalLM")
        refuse(hf, "layer_types", (None,), " by MixtralForCausalLM")
        for key in ("num_local_experts", "num_experts_per_tok"):
            require(hf.get(key) is not None, f"config.json lacks {key}")
        fields = dense_fields({"rope_theta": DEFAULT_THETA, **hf})
        window = hf.get("sliding_window")
        sliding = {}
        if window is not None:
            types = ("sliding_attention",) * fields["num_hidden_layers"]
            sliding = {"sliding_window": int(window), "layer_types": types}
        return ModelConfig(
            **fields,
            architecture=cls.architecture,
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            **sliding,
        )
