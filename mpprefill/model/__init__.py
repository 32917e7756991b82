"""The model: config, ragged prefill batch, Llama/Qwen2 decoder and checkpoint loader."""

from mpprefill.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.llama import LlamaForCausalLM
from mpprefill.model.loader import load_model, read_config

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ForwardBatch",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "read_config",
]
