"""ProcessWorker: the scheduler's side of the forward process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Iterator

import torch

import ipc
from ipc.events import EventAbandoned, EventTimeout
from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.worker.base import ForwardResult, ForwardSnapshot, Worker, WorkerDied
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.factory import swa_slots
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.ordering import (
    NUM_EVENTS,
    NUM_SLOTS,
    SchedulerOrder,
    forward_gen,
    make_events,
    sample_gen,
)
from mpprefill.worker.proc_main import WorkerSetup, worker_main
from mpprefill.worker.staging import make_staging, staging_specs

logger = logging.getLogger(__name__)
TAG = "mpp"
START_TIMEOUT = 300.0


class ProcessWorker(Worker):
    """Spawns the forward process; snapshots travel through two shared staging slots."""

    kind = "process"

    def __init__(self, args: ServerArgs):
        ipc.sweep_stale(TAG)
        self.args, self.plan = args, DevicePlan.of(args.device, args.staging)
        self.prefix = ipc.new_prefix(TAG)
        self.max_reqs = args.max_running_requests
        self.staging = make_staging(_specs(args), self.prefix, self.plan)
        self._events_st = ipc.SharedTensor.create((NUM_EVENTS,), torch.int64, self.prefix)
        events, cuda_events = make_events(self.plan, "scheduler", self._events_st.tensor)
        self._pending: ForwardSnapshot | None = None
        self._kv: KVCache | None = None
        self.channel = ipc.Channel(ipc.ipc_endpoint(f"fw-{self.prefix}"), bind=True)
        setup = WorkerSetup.of(
            dataclasses.asdict(args),
            self.plan,
            self.prefix,
            self._events_st.handle,
            cuda_events or None,
            self.staging.handles,
            self.max_reqs,
        )
        self.proc = mp.get_context("spawn").Process(
            target=worker_main,
            name="mpprefill-forward",
            daemon=True,
            args=(setup, self.channel.endpoint, os.getpid()),
        )
        self.proc.start()
        self.channel.set_peer(self.proc.pid)
        self.order = SchedulerOrder(events, alive=self.proc.is_alive)
        self.kv_fence = KVWriteFence(
            args.num_pages, args.page_size, self.order.kv_written, self.order.kv_written_query
        )
        self._attach(self._get(START_TIMEOUT))

    def _attach(self, ready) -> None:
        if not isinstance(ready, Ready):
            raise WorkerDied(f"forward process sent {type(ready).__name__} instead of Ready")
        self._ready = ready
        self.model_config = ModelConfig(**ready.model_config)
        self.result = ipc.open_bundle(ready.result)

    @property
    def kv_cache(self) -> KVCache:
        """The worker's pool, opened on first use (on a GPU this is the scheduler's first
        CUDA call with pinned staging). Read its pages only after `kv_fence`."""
        if self._kv is None:
            self._kv = KVCache.for_model(
                self.model_config,
                self.args.num_pages * self.args.page_size,
                buffer=ipc.open_handle(self._ready.kv),
                num_swa_slots=swa_slots(self.args),
            )
        return self._kv

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, snap: ForwardSnapshot, early_send_prefix: bool) -> None:
        if early_send_prefix:
            raise ValueError(
                "the forward process cannot reach requests; early send "
                "belongs to the scheduler thread"
            )
        if self._pending is not None:
            raise RuntimeError("submit before the previous forward was collected")
        slot = snap.seq % NUM_SLOTS
        with self._events():
            counts = self.staging.write(slot, snap.seq, snap.forward, snap.sampling, self.order)
        self.kv_fence.note_writes(snap.seq, snap.forward.out_cache_loc)
        n_tok, n_req, n_kv = counts
        self._put(Submit(snap.seq, slot, n_tok, n_req, n_kv, snap.delay_sample, snap.return_logits))
        self._pending = snap

    def collect(self, timeout: float | None = None) -> ForwardResult:
        snap = self._pending
        if snap is None:
            raise RuntimeError("collect with nothing submitted")
        done = self._get(timeout)
        t0 = time.perf_counter()
        with self._events():
            self.order.before_result(forward_gen(done.seq), timeout)
        waited = time.perf_counter() - t0
        self._pending = None
        b = snap.forward.batch_size
        tokens = self.result["tokens"][:b].clone() if done.sampled else None
        want = snap.return_logits or snap.delay_sample
        logits = self.result["logits"][:b].clone() if want else None
        return ForwardResult(done.seq, tokens, logits, done.forward_s + waited)

    def sample(self, result: ForwardResult, snap: ForwardSnapshot) -> torch.Tensor:
        self._put(Sample(snap.seq))
        self._get(None)
        with self._events():
            self.order.before_result(sample_gen(snap.seq))
        return self.result["tokens"][: snap.forward.batch_size].clone()

    @contextlib.contextmanager
    def _events(self) -> Iterator[None]:
        """Event waits fail as the worker's death does."""
        try:
            yield
        except EventAbandoned:
            raise WorkerDied(self._death()) from None
        except EventTimeout as e:
            raise WorkerDied(f"forward process stalled: {e}") from None

    def _put(self, msg) -> None:
        try:
            self.channel.put(msg, timeout=60)
        except ipc.PeerDied:
            raise WorkerDied(self._death()) from None

    def _get(self, timeout: float | None):
        try:
            msg = self.channel.get(timeout)
        except ipc.PeerDied:
            raise WorkerDied(self._death()) from None
        if isinstance(msg, Failed):
            raise WorkerDied(f"forward process failed: {msg.error}")
        if not isinstance(msg, Done | Ready):
            raise WorkerDied(f"unexpected message from the forward process: {msg!r}")
        return msg

    def _death(self) -> str:
        report = None
        with contextlib.suppress(ipc.MailboxError):  # its last words, if it said any
            report = self.channel.get(timeout=0)
        self.proc.join(1)
        if isinstance(report, Failed):
            return f"forward process failed: {report.error}"
        return f"forward process died (exit code {self.proc.exitcode})"

    @property
    def mailbox_bytes(self) -> int:
        return self.channel.bytes_sent + self.channel.bytes_recv

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(ipc.MailboxError):
                self.channel.put(Exit("close"), timeout=2)
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.staging.unlink()
        self._events_st.unlink()
        ipc.remove_prefix(self.prefix)  # whatever the forward process left behind
        self.channel.close()


def _specs(args: ServerArgs):
    ctx_len = args.context_length or 1 << 16
    max_tokens = max(
        args.max_prefill_tokens,
        args.chunked_prefill_size,
        ctx_len if args.chunked_prefill_size == -1 else 0,
    )
    max_kv = args.max_running_requests * ctx_len
    swa = args.model_config().has_sliding_layers
    return staging_specs(max_tokens, args.max_running_requests, max_kv, swa)
