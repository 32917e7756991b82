"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (`kv_lora_rank`,
`q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`;
see `layers/mla.py`) over a latent KV pool, and from layer `first_k_dense_replace` on a
mixture of `n_routed_experts` experts of `moe_intermediate_size` rows with DeepSeek's
grouped sigmoid routing (`n_group`, `topk_group`, `norm_topk_prob`,
`routed_scaling_factor`, the router's `e_score_correction_bias`) and `n_shared_experts`
shared experts; the first layers keep a dense MLP of `intermediate_size` rows. As
transformers reads it; its multi-token-prediction layers (`num_nextn_predict_layers`) are
not part of the forward. At several tensor-parallel ranks the heads are split and the
latent pool is replicated (see `layers/mla.py`)."""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.hf_config import dense_fields, refuse, require

# transformers' defaults where config.json names none
DEFAULTS = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
}
_REQUIRED = tuple(k for k in DEFAULTS if k != "q_lora_rank")  # q_lora_rank null: no LoRA


class DeepseekV3ForCausalLM(CausalLM):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        # NOTE: transformers 5 may write n_routed_experts as num_local_experts.
        hf = {**DEFAULTS, "n_routed_experts": hf.get("num_local_experts"), **hf}
        for key in _REQUIRED:
            require(hf[key] is not None, f"config.json's {key} is null")
        refuse(hf, "attention_bias", (None, False), " (DeepSeek-V3 has no attention biases)")
        refuse(hf, "scoring_func", (None, "sigmoid"), " (only sigmoid routing)")
        refuse(hf, "topk_method", (None, "noaux_tc"), " (only grouped top-k, noaux_tc)")
        refuse(hf, "moe_layer_freq", (None, 1), " (every layer past the dense ones is MoE)")
        heads = hf["num_attention_heads"]
        refuse(hf, "num_key_value_heads", (None, heads), " (MLA: one per attention head)")
        fields = dense_fields(hf)
        rope_dim = int(hf["qk_rope_head_dim"])
        layers = fields["num_hidden_layers"]
        experts = int(hf["n_routed_experts"])
        moe_rows = int(hf["moe_intermediate_size"])
        return ModelConfig(
            **{**fields, "head_dim": rope_dim, "num_key_value_heads": heads},
            architecture=cls.architecture,
            kv_lora_rank=int(hf["kv_lora_rank"]),
            q_lora_rank=None if hf["q_lora_rank"] is None else int(hf["q_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(hf["v_head_dim"]),
            rope_interleave=bool(hf["rope_interleave"]),
            num_experts=experts,
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=moe_rows,
            norm_topk_prob=bool(hf["norm_topk_prob"]),
            dense_mlp_layers=tuple(range(min(int(hf["first_k_dense_replace"]), layers))),
            moe_scoring="sigmoid",
            n_group=int(hf["n_group"]),
            topk_group=int(hf["topk_group"]),
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            shared_expert_intermediate_size=moe_rows * int(hf["n_shared_experts"]),
        )
