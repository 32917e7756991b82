"""Mistral (`MistralForCausalLM`): the Llama decoder without biases; its `sliding_window`
(4096 where config.json names none, as transformers defaults it; null turns it off)
applies to every layer."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, refuse

DEFAULT_WINDOW = 4096


class MistralForCausalLM(CausalLM):
    architecture = "MistralForCausalLM"
    model_type = "mistral"

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        refuse(hf, "attention_bias", (None, False), " by MistralForCausalLM")
        # NOTE: transformers' Mistral ignores layer_types (Ministral reads them): refused.
        refuse(hf, "layer_types", (None,), " by MistralForCausalLM")
        fields = dense_fields(hf)
        window = hf.get("sliding_window", DEFAULT_WINDOW)
        sliding = {}
        if window is not None:
            types = ("sliding_attention",) * fields["num_hidden_layers"]
            sliding = {"sliding_window": int(window), "layer_types": types}
        return ModelConfig(**fields, architecture=cls.architecture, **sliding)
