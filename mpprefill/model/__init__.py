"""The model: config, ragged prefill batch, the shared decoder and its layers, one module
per family (`families/`, with the registry) and the checkpoint loader."""

from mpprefill.model.config import ModelConfig
from mpprefill.model.decoder import CausalLM
from mpprefill.model.families import build_model, config_from_hf
from mpprefill.model.families.llama import LlamaForCausalLM
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.loader import load_model

__all__ = [
    "CausalLM",
    "ForwardBatch",
    "LlamaForCausalLM",
    "ModelConfig",
    "build_model",
    "config_from_hf",
    "load_model",
]
