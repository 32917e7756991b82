"""ScheduleBatch: the requests of one prefill batch and the tensors built for them."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from mpprefill.model import ForwardBatch
from mpprefill.sampling import SamplingBatchInfo
from mpprefill.scheduling.req import Req


@dataclass(slots=True, eq=False)
class ScheduleBatch:
    seq: int
    reqs: list[Req]
    forward: ForwardBatch
    sampling_info: SamplingBatchInfo
    spec_info: Any = None
    delay_sample: bool = False
    return_logits: bool = False
    fill_lens: list[int] = field(default_factory=list)  # each req's KV end after this batch
    new_tokens: int = 0  # tokens computed by this batch
    cached_tokens: int = 0  # tokens of first-admitted requests served from the cache

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def copy(self) -> ScheduleBatch:
        """Shallow: result processing keeps the same Req objects (and the same list)."""
        return copy.copy(self)

    def filter(self, keep: list[int]) -> None:
        """Keep the given rows, rebinding fields in place (as admission does)."""
        self.reqs = [self.reqs[i] for i in keep]
        self.sampling_info.filter(keep)

    def __repr__(self) -> str:
        return f"ScheduleBatch(seq={self.seq}, reqs={len(self.reqs)}, tokens={self.new_tokens})"


def build_forward_batch(input_ids, prefix_lens, seq_lens, out, kv_rows) -> ForwardBatch:
    """The model's tensors for one batch: new tokens, their positions and slots, KV rows."""
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        out_cache_loc=out,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        extend_lens=torch.tensor([s - p for p, s in zip(prefix_lens, seq_lens)], dtype=torch.int64),
        kv_indices=torch.cat(kv_rows),
    )
