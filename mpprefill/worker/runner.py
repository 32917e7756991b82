"""ForwardRunner: forward and sampling next to the model and the KV pool.

It knows nothing of requests: tensors in, logits and tokens out. Where the forward's
device work completes later than the call returns (the emulated accelerator), the output
says when (`end_ns`); readers of its results or KV pages wait for that time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ForwardBatch
from mpprefill.model.guard import ForwardGuard, plain
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import Logprobs
from mpprefill.sampling.sampler import Sampled, sample_with_logprobs
from mpprefill.trace.tracer import clock_ns, get_tracer
from mpprefill.worker.api import ForwardInput

T = TypeVar("T", ForwardBatch, SamplingBatchInfo)
OnLayer = Callable[[int], None]


class RunOutput(NamedTuple):
    """NOTE: ForwardResult's fields after `seq`, in its order (local workers splat it)."""

    next_token_ids: torch.Tensor | None  # [B] int64; None when sampling is deferred
    logits: torch.Tensor  # [B, vocab] float32, last position of each request
    forward_s: float  # host time of the call
    start_ns: int  # when the device began and finished this forward (clock_ns)
    end_ns: int
    device_s: float  # the device's busy time in it
    collective_s: float  # the part of device_s in collectives (emulated tensor parallel)
    logprobs: Logprobs | None = None  # of the sampled tokens, where a row asks


class ForwardRunner:
    """Runs one forward at a time on `kv.device`. `device` (optional) is an emulated
    accelerator: it shrinks the batch the host computes and charges device time."""

    # A test hook (`DeviceHooks.forward_guard`): each forward runs under it, failing on a
    # read of the batch's device tensors; its call counts go to `guard_log`.
    guard: ForwardGuard | None = None
    guard_log: str | None = None

    def __init__(self, model: CausalLM, kv: KVCache, device=None):
        self.model = model
        self.kv = kv
        self.device = device
        self.vocab_size = model.config.vocab_size

    @torch.inference_mode()
    def forward(self, inp: ForwardInput, on_layer: OnLayer | None = None) -> RunOutput:
        """`on_layer(i)` runs once layer i's work (its KV writes included) is issued: the
        worker publishes each layer's completion there (`layers.py`)."""
        t0 = clock_ns()
        fb = self.on_device(inp.forward)
        sampling = self.on_device(inp.sampling)
        run = self._forward if self.guard is None else self._guarded
        logits = run(fb, on_layer)
        sampled = None if inp.delay_sample else sample_with_logprobs(logits, sampling)
        tokens = None if sampled is None else sampled.tokens
        logprobs = None if sampled is None else sampled.logprobs
        t1 = clock_ns()
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record("forward", t0, t1 - t0, inp.seq)
        forward_s = (t1 - t0) / 1e9
        if self.device is None:
            return RunOutput(tokens, logits, forward_s, t0, t1, forward_s, 0.0, logprobs)
        return RunOutput(tokens, logits, forward_s, *self.device.last_forward(), logprobs)

    def _forward(self, fb: ForwardBatch, on_layer: OnLayer | None) -> torch.Tensor:
        if self.device is None:
            return self.model(fb, self.kv, on_layer)
        return self.device.forward(self.model, fb, self.kv, on_layer)

    def _guarded(self, fb: ForwardBatch, on_layer: OnLayer | None) -> torch.Tensor:
        with self.guard.watch(fb) as guarded:
            logits = plain(self._forward(guarded, on_layer))
        if self.guard_log is not None:
            with open(self.guard_log, "a") as f:
                f.write(f"{fb.batch_size} {fb.num_tokens} {self.guard.calls}\n")
        return logits

    def set_guard(self, log_dir: str) -> None:
        """Run every forward under a ForwardGuard; append "requests tokens calls" lines
        to a file of this process's in `log_dir`."""
        self.guard = ForwardGuard()
        self.guard_log = os.path.join(log_dir, f"forward-calls-{os.getpid()}.txt")

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatchInfo) -> Sampled:
        return sample_with_logprobs(logits, self.on_device(sampling))

    def on_device(self, batch: T) -> T:
        """`batch` (a ForwardBatch or SamplingBatchInfo) with its tensors where the KV is;
        the local workers hand over host tensors, the forward process device ones."""
        first = batch.input_ids if isinstance(batch, ForwardBatch) else batch.top_ps
        return batch if first.device == self.kv.device else batch.to(self.kv.device)


def set_torch_threads(n: int) -> None:
    torch.set_num_threads(n if n > 0 else max(1, os.cpu_count() or 1))
