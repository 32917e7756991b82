"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k norms, `head_dim`
explicit or hidden / heads, biases with `attention_bias`) and a mixture of `num_experts`
experts of `moe_intermediate_size` rows on layer i unless i is in `mlp_only_layers` or
(i + 1) is not a multiple of `decoder_sparse_step`; those layers keep a dense MLP of
`intermediate_size` rows. Each token goes to `num_experts_per_tok` experts, their weights
renormalised only with `norm_topk_prob`. With `use_sliding_window` every layer slides
(`sliding_window`, 4096 by default), as transformers' Qwen3-MoE masks them."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, refuse

# transformers' defaults where config.json names none
DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
}


class Qwen3MoeForCausalLM(CausalLM):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    qk_norm = True

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        refuse(hf, "layer_types", (None,), " by Qwen3MoeForCausalLM")
        for shared in ("shared_expert_intermediate_size", "num_shared_experts"):
            refuse(hf, shared, (None, 0), " (Qwen3-MoE has no shared experts)")
        fields = dense_fields(hf)
        bias = bool(hf.get("attention_bias", False))
        # NOTE: transformers 5 writes num_experts as num_local_experts.
        hf = {"num_experts": hf.get("num_local_experts"), **hf}
        experts = _int(hf, "num_experts")
        return ModelConfig(
            **fields,
            attention_bias=bias,
            attention_out_bias=bias,
            architecture=cls.architecture,
            num_experts=experts,
            num_experts_per_tok=_int(hf, "num_experts_per_tok"),
            moe_intermediate_size=_int(hf, "moe_intermediate_size"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            dense_mlp_layers=dense_layers(hf, experts, _int(hf, "decoder_sparse_step")),
            **sliding(hf, fields["num_hidden_layers"]),
        )


def _int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    return int(DEFAULTS[key] if value is None else value)


def dense_layers(hf: dict[str, Any], experts: int, step: int) -> tuple[int, ...]:
    """The layers transformers gives a dense MLP: `mlp_only_layers`, and those whose index
    + 1 is not a multiple of `decoder_sparse_step`."""
    only = set(hf.get("mlp_only_layers") or ())
    n = hf["num_hidden_layers"]
    return tuple(i for i in range(n) if experts == 0 or i in only or (i + 1) % step)


def sliding(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    if not hf.get("use_sliding_window", False):
        return {}
    window = hf.get("sliding_window", 4096)
    if window is None:
        return {}
    return {"sliding_window": int(window), "layer_types": ("sliding_attention",) * layers}
