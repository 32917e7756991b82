"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): biases on q, k and v (not o); sliding windows on
layers from `max_window_layers` on, only with `use_sliding_window`."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, layer_sliding


class Qwen2ForCausalLM(CausalLM):
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        # NOTE: transformers drops the window unless use_sliding_window is set.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return ModelConfig(
            **dense_fields(hf),
            attention_bias=True,
            attention_out_bias=False,
            architecture=cls.architecture,
            **layer_sliding(hf, window, hf.get("max_window_layers", 28)),
        )
