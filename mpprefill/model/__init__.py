"""The model: config, ragged prefill batch, Llama/Qwen2 decoder and checkpoint loader."""

from mpprefill.model.config import ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.llama import LlamaForCausalLM
from mpprefill.model.loader import load_model

__all__ = [
    "ForwardBatch",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
]
