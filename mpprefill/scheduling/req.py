"""A prefill request and its lifecycle state; it never leaves the scheduler process."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.token_logprob import TokenLogprob


class ReqStatus(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # waiting for its decode side
    WAITING = "waiting"  # admissible
    RUNNING = "running"  # has KV; chunks in flight or pending
    TRANSFERRING = "transferring"  # prefill done, KV going out
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    bootstrap_room: int | None = None
    return_logits: bool = False
    status: ReqStatus = ReqStatus.WAITING
    # KV state (see RadixCache.cache_*_req)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    swa_evicted_len: int = 0  # SWA KV of positions below this was freed (out of window)
    fill_ids: list[int] = field(default_factory=list)
    # NOTE: incremented when a non-final chunk is admitted, decremented when its result
    # is processed; <= 0 at processing time means the final chunk. Lives on the real Req.
    inflight_middle_chunks: int = 0
    is_chunked: bool = False
    cached_tokens: int = 0  # prompt tokens served from a cache at first admission
    prefix_key: tuple | None = None  # its first uncached page while being computed
    # transfer state
    sender: Any = None
    start_send_idx: int = 0
    # results
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # with return_logprob
    logits: torch.Tensor | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def seq_len(self) -> int:
        """Tokens with KV after the chunk now scheduled."""
        return len(self.fill_ids)

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_indices)

    @property
    def finished(self) -> bool:
        return self.status in (ReqStatus.DONE, ReqStatus.FAILED)

    @property
    def first_token(self) -> int | None:
        return self.output_ids[0] if self.output_ids else None

    @property
    def first_logprob(self) -> TokenLogprob | None:
        """The first token's logprob and alternatives; None unless it asked (return_logprob)."""
        return self.output_logprobs[0] if self.output_logprobs else None

    def is_last_chunk(self) -> bool:
        return len(self.fill_ids) == len(self.origin_input_ids)

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, len={self.prompt_len}, status={self.status.value}, "
            f"fill={len(self.fill_ids)}, prefix={self.prefix_len}, "
            f"chunks={self.inflight_middle_chunks})"
        )
