"""The worker boundary: what crosses it is tensors, never requests.

The scheduler hands a worker a `ForwardInput` (the batch's tensors and sampling rows, tagged
with the batch's sequence number) and gets a `ForwardResult` back. Up to `max_in_flight`
forwards may be submitted before the oldest is collected; results come back in order. A
result's tensors are read only after `wait_ready()`, as a GPU's outputs are read only
after their copy completed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import Logprobs
from mpprefill.sampling.sampler import Sampled

if TYPE_CHECKING:
    from mpprefill.memory.kv_cache import KVCache
    from mpprefill.worker.fence import KVWriteFence
    from mpprefill.worker.layers import LayerProgress


def sleep_until_ns(t_ns: int) -> None:
    """Sleep until clock_ns (monotonic) reaches `t_ns`; return at once if it has."""
    left = t_ns / 1e9 - time.monotonic()
    if left > 0:
        time.sleep(left)


@dataclass(slots=True, eq=False)
class ForwardInput:
    """One forward as the worker sees it."""

    seq: int
    forward: ForwardBatch
    sampling: SamplingBatchInfo
    delay_sample: bool = False
    return_logits: bool = False

    @property
    def batch_size(self) -> int:
        return self.forward.batch_size


class ForwardResult(NamedTuple):
    seq: int
    next_token_ids: torch.Tensor | None
    logits: torch.Tensor | None
    forward_s: float  # host time of the forward call (issue, plus the wait where it waited)
    start_ns: int = 0  # when the worker (or its device) began and finished it, on clock_ns
    end_ns: int = 0
    device_s: float = 0.0  # the device's busy time in it
    collective_s: float = 0.0  # the part of device_s in collectives (emulated tensor parallel)
    logprobs: Logprobs | None = None  # of next_token_ids, where a row asks (sampling.logprob_rows)

    def wait_ready(self) -> None:
        """Return once the forward's device work is done (at once unless the device runs
        behind the host, as the emulated accelerator does); sleeps without the GIL."""
        sleep_until_ns(self.end_ns)


class WorkerDied(RuntimeError):
    """The forward worker failed; every request in flight must get an error."""


class Worker:
    """submit(N) [submit(N+1)] collect() -> N [sample(N)] ...: forwards run one at a time,
    in submission order."""

    # How many forwards may be submitted and not yet collected: one running, one waiting.
    max_in_flight = 1
    # Readers and writers of the KV pool outside the worker (transfer backend, host store)
    # pass this first; None where no forward runs while the scheduler thread works (inline).
    kv_fence: KVWriteFence | None = None
    # How far each forward has written its KV, layer by layer (`layers.py`), for the
    # transfer thread's layer-wise sends; None where the worker does not publish it.
    layer_progress: LayerProgress | None = None
    # The collected forward whose deferred sample is due, by sequence number.
    _sample_due: int | None = None

    def submit(self, inp: ForwardInput) -> None:
        raise NotImplementedError

    def collect(self, timeout: float | None = None) -> ForwardResult:
        raise NotImplementedError

    def sample(self, inp: ForwardInput, timeout: float | None = None) -> Sampled:
        """Deferred sampling of the last collected forward; the worker is idle here."""
        raise NotImplementedError

    @property
    def sentinel(self) -> int | None:
        """A file descriptor that turns readable when the worker dies (a forward process's
        sentinel), for the front's poll; None for a worker inside this process."""
        return None

    def death(self) -> str | None:
        """Why the worker can no longer run forwards, or None while it can."""
        return None

    @property
    def mailbox_bytes(self) -> int:
        """Bytes that crossed a process boundary so far (0 within one process)."""
        return 0

    def close(self) -> None:
        pass

    def kill_now(self) -> None:
        """Stop at once, for a process that exits right after (a second signal)."""
        self.close()

    def _note_collected(self, inp: ForwardInput) -> None:
        self._sample_due = inp.seq if inp.delay_sample else None

    def _check_sample(self, inp: ForwardInput, pending: Sequence[ForwardInput]) -> None:
        """Raise unless `inp` is the last collected forward, deferred, and the worker idle:
        sampling anything else would read another batch's logits."""
        if pending:
            raise RuntimeError(f"sample {inp.seq} while forward {pending[0].seq} is in flight")
        if self._sample_due != inp.seq:
            due = self._sample_due
            raise RuntimeError(f"sample {inp.seq}, but the deferred forward due is {due}")
        self._sample_due = None

    def _check_room(self, pending: Sequence[ForwardInput]) -> None:
        """Raise unless one more forward may join `pending` (submitted, not collected)."""
        if len(pending) >= self.max_in_flight:
            raise RuntimeError(f"more than {self.max_in_flight} forwards submitted")
        if pending and pending[-1].delay_sample:
            raise RuntimeError("submit before the deferred sample of the previous forward")

    @property
    def kv_cache(self) -> KVCache:
        """The KV pool as the scheduler's transfer backend reads it."""
        raise NotImplementedError

    def kv_shards(self) -> list[tuple[KVCache, range]]:
        """Every tensor-parallel rank's KV pool and the model's KV heads it holds, rank 0
        first; one worker of one pool: that pool, every head."""
        kv = self.kv_cache
        return [(kv, range(kv.buffer.shape[3]))]
