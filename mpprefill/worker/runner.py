"""ForwardRunner: forward and sampling next to the model and the KV pool."""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM
from mpprefill.sampling import SamplingBatchInfo, sample
from mpprefill.trace.tracer import clock_ns, get_tracer

T = TypeVar("T", ForwardBatch, SamplingBatchInfo)


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
        fb, sampling = self.on_device(fb), self.on_device(sampling)
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
        return sample(logits, self.on_device(sampling))

    def on_device(self, batch: T) -> T:
        """`batch` (a ForwardBatch or SamplingBatchInfo) with its tensors where the KV is;
        the local workers hand over host tensors, the forward process device ones."""
        first = batch.input_ids if isinstance(batch, ForwardBatch) else batch.top_ps
        return batch if first.device == self.kv.device else batch.to(self.kv.device)
