"""Llama 2 and 3.x (`LlamaForCausalLM`): the plain decoder; llama3 (and any other
supported) rope scaling; `attention_bias` puts biases on q, k, v and o."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, refuse


class LlamaForCausalLM(CausalLM):
    architecture = "LlamaForCausalLM"
    model_type = "llama"

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        refuse(hf, "pretraining_tp", (None, 1))
        bias = bool(hf.get("attention_bias", False))
        return ModelConfig(
            **dense_fields(hf),
            attention_bias=bias,
            attention_out_bias=bias,
            architecture=cls.architecture,
        )
