"""ForwardRunner: forward and sampling next to the model and the KV pool."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM
from mpprefill.sampling import SamplingBatchInfo, sample


class RunOutput(NamedTuple):
    next_token_ids: torch.Tensor | None  # [B] int64; None when sampling is deferred
    logits: torch.Tensor  # [B, vocab] float32, last position of each request
    forward_s: float


class ForwardRunner:
    """Knows nothing of requests: tensors in, logits and tokens out."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache):
        self.model, self.kv = model, kv
        self.vocab_size = model.config.vocab_size
        self.num_forwards = 0

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, sampling: SamplingBatchInfo, delay_sample: bool = False
    ) -> RunOutput:
        t0 = time.perf_counter()
        logits = self.model(fb, self.kv)
        tokens = None if delay_sample else sample(logits, sampling)
        self.num_forwards += 1
        return RunOutput(tokens, logits, time.perf_counter() - t0)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatchInfo) -> torch.Tensor:
        return sample(logits, sampling)
