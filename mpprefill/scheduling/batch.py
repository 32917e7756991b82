"""ScheduleBatch: the requests of one prefill batch and the tensors built for them; and
ForwardSnapshot, what a submitted forward keeps while admission rebinds the live batch."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.scheduling.req import Req
from mpprefill.worker.api import ForwardInput


@dataclass(slots=True, eq=False)
class ScheduleBatch:
    seq: int
    reqs: list[Req]
    forward: ForwardBatch
    sampling_info: SamplingBatchInfo
    delay_sample: bool = False
    return_logits: bool = False
    fill_lens: list[int] = field(default_factory=list)  # each req's KV end after this batch
    new_tokens: int = 0  # tokens computed by this batch

    def copy(self) -> ScheduleBatch:
        """Shallow: result processing keeps the same Req objects (and the same list)."""
        return copy.copy(self)

    def __repr__(self) -> str:
        return f"ScheduleBatch(seq={self.seq}, reqs={len(self.reqs)}, tokens={self.new_tokens})"


@dataclass(slots=True, eq=False)
class ForwardSnapshot:
    """What a submitted forward sees; admission may rebind the live batch meanwhile.

    batch: a shallow copy (its `reqs` are the real Req objects, which never leave the
    scheduler); input: the tensors handed to the worker, with the sampling rows copied by
    `copy_for_forward()`.
    """

    batch: ScheduleBatch
    input: ForwardInput

    @classmethod
    def take(cls, batch: ScheduleBatch) -> ForwardSnapshot:
        inp = ForwardInput(
            seq=batch.seq,
            forward=batch.forward,
            sampling=batch.sampling_info.copy_for_forward(),
            delay_sample=batch.delay_sample,
            return_logits=batch.return_logits,
        )
        return cls(batch.copy(), inp)

    @property
    def seq(self) -> int:
        return self.input.seq


def build_forward_batch(input_ids, prefix_lens, seq_lens, out, kv_rows) -> ForwardBatch:
    """The model's tensors for one batch: new tokens, their positions and slots, KV rows."""
    positions = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
    extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        out_cache_loc=out,
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64),
        kv_indices=torch.cat(kv_rows),
        prefix_lens_cpu=tuple(prefix_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
