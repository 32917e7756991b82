"""The registry: config.json's `architectures` (or `model_type`) to the family that reads
its config, builds its model and maps its checkpoint names. A family is one module here
and one line below."""

from __future__ import annotations

from typing import Any

import torch

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.families.deepseek_v3 import DeepseekV3ForCausalLM
from mpprefill.model.families.gpt_oss import GptOssForCausalLM
from mpprefill.model.families.llama import LlamaForCausalLM
from mpprefill.model.families.mistral import MistralForCausalLM
from mpprefill.model.families.mixtral import MixtralForCausalLM
from mpprefill.model.families.qwen2 import Qwen2ForCausalLM
from mpprefill.model.families.qwen3 import Qwen3ForCausalLM
from mpprefill.model.families.qwen3_moe import Qwen3MoeForCausalLM
from mpprefill.model.parallel import TPRank

FAMILIES: dict[str, type[CausalLM]] = {
    f.architecture: f
    for f in (
        LlamaForCausalLM,
        Qwen2ForCausalLM,
        MistralForCausalLM,
        Qwen3ForCausalLM,
        MixtralForCausalLM,
        Qwen3MoeForCausalLM,
        GptOssForCausalLM,
        DeepseekV3ForCausalLM,
    )
}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def family(architecture: str) -> type[CausalLM]:
    if architecture not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[architecture]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of an HF config.json dict, read by its family; fields it cannot
    run raise, naming them."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        found = _BY_MODEL_TYPE.get(hf.get("model_type", ""))
        arch = found.architecture if found else str(hf.get("model_type"))
    return family(arch).config_from_hf(hf)


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", tp: TPRank | None = None
) -> CausalLM:
    """The family's model of `config`, weights uninitialised (see CausalLM)."""
    return family(config.architecture)(config, device=device, tp=tp)
