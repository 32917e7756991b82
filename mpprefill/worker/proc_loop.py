"""The forward process's loop: one message at a time, device work issued on one stream.

Per Submit, in stream order: wait "staged", read the slot, forward, record "reads done"
(after the copy-in when the slot was copied, else after the forward), "forward done",
write the result slot, record "result ready". Then flush (publish what a host-only
scheduler waits on) and reply. On a GPU with cuda-ipc staging the reply leaves before the
device finished; the scheduler reads results and KV only after their events.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

import ipc
from mpprefill.model import ForwardBatch
from mpprefill.sampling import SamplingBatchInfo
from mpprefill.worker.device import HostStream
from mpprefill.worker.emulation import LaggingStream, LateReads
from mpprefill.worker.messages import Done, Exit, Sample, Submit
from mpprefill.worker.ordering import WorkerOrder, forward_gen, sample_gen
from mpprefill.worker.runner import ForwardRunner
from mpprefill.worker.staging import read_slot


@dataclasses.dataclass
class WorkerLoop:
    ch: ipc.Channel
    runner: ForwardRunner
    slots: list[dict[str, torch.Tensor]]  # both staging slots, opened once
    result: dict[str, torch.Tensor]  # the result slot (host shared memory)
    order: WorkerOrder
    stream: HostStream
    late_reads: LateReads | None = None
    last: tuple | None = None  # (logits, sampling) of the last forward, for deferred sampling

    def serve(self) -> None:
        while True:
            msg = self._next()
            if isinstance(msg, Exit):
                self.stream.drain()
                return
            t0 = time.perf_counter()
            if isinstance(msg, Submit):
                if self.late_reads is not None:
                    self.late_reads.before_reuse(msg.slot)
                self.stream.run(partial(self._forward, msg))
                sampled = not msg.delay_sample
            elif isinstance(msg, Sample):
                self.stream.run(partial(self._sample, msg))
                sampled = True
            else:
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
            self.order.flush()
            self.stream.check()
            self.ch.put(Done(msg.seq, time.perf_counter() - t0, sampled))

    def _next(self):
        if not isinstance(self.stream, LaggingStream):
            return self.ch.get()
        while True:  # the lagging device may fail while the scheduler waits on its events
            self.stream.check()
            try:
                return self.ch.get(timeout=0.05)
            except ipc.MailboxTimeout:
                continue

    def _forward(self, msg: Submit) -> None:
        o, slot, seq = self.order, msg.slot, msg.seq
        o.before_read(slot, seq)
        fb, sampling, copied = read_slot(
            self.slots[slot], msg.num_tokens, msg.num_reqs, msg.num_kv, self.runner.kv.device
        )
        if copied:
            o.reads_done(slot, seq)
        out = self.runner.forward(fb, sampling, msg.delay_sample, seq)
        self.last = (out.logits.clone(), _own_copy(sampling)) if msg.delay_sample else None
        if not copied:
            self._release(slot, seq, fb)
        o.forward_done(seq)
        want_logits = msg.want_logits or msg.delay_sample
        self._write_result(out.next_token_ids, out.logits if want_logits else None)
        o.result_ready(forward_gen(seq))

    def _sample(self, msg: Sample) -> None:
        if self.last is None:
            raise RuntimeError(f"Sample {msg.seq} without a deferred forward")
        tokens = self.runner.sample(*self.last)
        self._write_result(tokens, None)
        self.order.result_ready(sample_gen(msg.seq))

    def _release(self, slot: int, seq: int, fb: ForwardBatch) -> None:
        record = partial(self.order.reads_done, slot, seq)
        if self.late_reads is None:
            record()
        else:
            self.late_reads.release(slot, seq, fb, record)

    def _write_result(self, tokens: torch.Tensor | None, logits: torch.Tensor | None) -> None:
        if tokens is not None:
            self.result["tokens"][: len(tokens)].copy_(tokens, non_blocking=True)
        if logits is not None:
            self.result["logits"][: len(logits)].copy_(logits, non_blocking=True)


def _own_copy(sampling: SamplingBatchInfo) -> SamplingBatchInfo:
    """Sampling rows that outlive the slot they were read from."""
    return dataclasses.replace(sampling, **{k: v.clone() for k, v in sampling.to_tensors().items()})
