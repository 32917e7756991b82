"""ForwardRunner: forward and sampling next to the model and the KV pool."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM
from mpprefill.sampling import SamplingBatchInfo, sample
from mpprefill.trace.tracer import clock_ns, get_tracer


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
        self,
        fb: ForwardBatch,
        sampling: SamplingBatchInfo,
        delay_sample: bool = False,
        seq: int = -1,
    ) -> RunOutput:
        t0 = clock_ns()
        logits = self.model(fb, self.kv)
        tokens = None if delay_sample else sample(logits, sampling)
        self.num_forwards += 1
        dur = clock_ns() - t0
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record("F", t0, dur, seq)
        return RunOutput(tokens, logits, dur / 1e9)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatchInfo) -> torch.Tensor:
        return sample(logits, sampling)
