"""Qwen3 (`Qwen3ForCausalLM`): RMS norms on each head of q and k before the rotary,
`head_dim` explicit (128 where config.json names none, as transformers defaults it), no
biases unless `attention_bias` (then on q, k, v and o); sliding windows as Qwen2 reads
them (`use_sliding_window`, `max_window_layers`, or `layer_types`)."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, layer_sliding

DEFAULT_HEAD_DIM = 128


class Qwen3ForCausalLM(CausalLM):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    qk_norm = True

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        bias = bool(hf.get("attention_bias", False))
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        return ModelConfig(
            **dense_fields(hf, head_dim=DEFAULT_HEAD_DIM),
            attention_bias=bias,
            attention_out_bias=bias,
            architecture=cls.architecture,
            **layer_sliding(hf, window, hf.get("max_window_layers", 28)),
        )
