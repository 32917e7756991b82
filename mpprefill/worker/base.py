"""The worker interface, snapshots and results shared by every forward mode."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mpprefill.model import ForwardBatch
from mpprefill.sampling import SamplingBatchInfo

if TYPE_CHECKING:
    from mpprefill.scheduling.batch import ScheduleBatch
    from mpprefill.worker.fence import KVWriteFence


@dataclass(slots=True, eq=False)
class ForwardSnapshot:
    """What a submitted forward sees; admission may rebind the live batch meanwhile.

    batch: shallow copy (its `reqs` are the real Req objects, never crossing a process);
    sampling: `copy_for_forward()`; spec_info: shallow copy when present.
    """

    seq: int
    batch: ScheduleBatch
    forward: ForwardBatch
    sampling: SamplingBatchInfo
    spec_info: Any = None
    delay_sample: bool = False
    return_logits: bool = False

    @classmethod
    def take(cls, batch: ScheduleBatch) -> ForwardSnapshot:
        live = copy.copy(batch)
        return cls(
            seq=batch.seq,
            batch=live,
            forward=batch.forward,
            sampling=batch.sampling_info.copy_for_forward(),
            spec_info=copy.copy(batch.spec_info) if batch.spec_info is not None else None,
            delay_sample=batch.delay_sample,
            return_logits=batch.return_logits,
        )


class ForwardResult(NamedTuple):
    seq: int
    next_token_ids: torch.Tensor | None
    logits: torch.Tensor | None
    forward_s: float


class WorkerDied(RuntimeError):
    """The forward worker failed; every request in flight must get an error."""


class Worker:
    """submit(N) -> collect() -> [sample()] -> submit(N+1): one forward at a time."""

    kind = "base"
    early_send_hook: Callable[[ForwardSnapshot], None] | None = None
    # Readers and writers of the KV pool outside the worker (transfer backend, host store)
    # pass this first; None where no forward runs while the scheduler thread works (inline).
    kv_fence: KVWriteFence | None = None

    def submit(self, snap: ForwardSnapshot, early_send_prefix: bool) -> None:
        raise NotImplementedError

    def collect(self, timeout: float | None = None) -> ForwardResult:
        raise NotImplementedError

    def sample(self, result: ForwardResult, snap: ForwardSnapshot) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def kv_cache(self):
        """The KV pool as the scheduler's transfer backend reads it."""
        raise NotImplementedError
