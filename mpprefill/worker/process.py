"""ProcessWorker: the scheduler's side of the forward process."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os

import torch

import ipc
from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.worker.base import ForwardResult, ForwardSnapshot, Worker, WorkerDied
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.proc_main import FORWARD_DONE, worker_main
from mpprefill.worker.staging import (
    NUM_SLOTS,
    check_capacity,
    staging_specs,
    write_slot,
)

logger = logging.getLogger(__name__)
TAG = "mpp"
START_TIMEOUT = 300.0


class ProcessWorker(Worker):
    """Spawns the forward process; snapshots travel through two shared staging slots."""

    kind = "process"

    def __init__(self, args: ServerArgs):
        ipc.sweep_stale(TAG)
        self.args = args
        self.prefix = ipc.new_prefix(TAG)
        self.max_reqs = args.max_running_requests
        ctx_len = args.context_length or 1 << 16
        max_tokens = max(
            args.max_prefill_tokens,
            args.chunked_prefill_size,
            ctx_len if args.chunked_prefill_size == -1 else 0,
        )
        self.specs = staging_specs(max_tokens, self.max_reqs, self.max_reqs * ctx_len)
        self.slots = [ipc.SharedBundle(self.specs, self.prefix) for _ in range(NUM_SLOTS)]
        self._events_st = ipc.SharedTensor.create((NUM_SLOTS + 1,), torch.int64, self.prefix)
        self.events = ipc.ShmEventTable(self._events_st.tensor)
        self._slot_seq = [0] * NUM_SLOTS
        self._pending: ForwardSnapshot | None = None
        self.channel = ipc.Channel(ipc.ipc_endpoint(f"fw-{self.prefix}"), bind=True)
        self.proc = mp.get_context("spawn").Process(
            target=worker_main,
            name="mpprefill-forward",
            daemon=True,
            args=(
                dataclasses.asdict(args),
                self.channel.endpoint,
                os.getpid(),
                self.prefix,
                self._events_st.handle,
                self.max_reqs,
            ),
        )
        self.proc.start()
        self.channel.set_peer(self.proc.pid)
        self._attach(self._get(START_TIMEOUT))

    def _attach(self, ready) -> None:
        if not isinstance(ready, Ready):
            raise WorkerDied(f"forward process sent {type(ready).__name__} instead of Ready")
        self.model_config = ModelConfig(**ready.model_config)
        layers, heads, dim = KVCache.model_dims(self.model_config)
        self._kv = KVCache(
            layers,
            self.args.num_pages * self.args.page_size,
            heads,
            dim,
            self.model_config.torch_dtype,
            buffer=ipc.open_handle(ready.kv),
        )
        self.result = ipc.open_bundle(ready.result)

    @property
    def kv_cache(self) -> KVCache:
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
        check_capacity(snap.forward, self.specs)
        slot = snap.seq % NUM_SLOTS
        # WAR barrier: the forward that last read this slot must be done reading it.
        self.events[slot].wait(self._slot_seq[slot], timeout=60, alive=self.proc.is_alive)
        n_tok, n_req, n_kv = write_slot(self.slots[slot].tensors, snap.forward, snap.sampling)
        self._slot_seq[slot] = snap.seq
        msg = Submit(
            snap.seq,
            slot,
            n_tok,
            n_req,
            n_kv,
            snap.delay_sample,
            snap.return_logits,
            self.slots[slot].handles,
        )
        self._put(msg)
        self._pending = snap

    def collect(self, timeout: float | None = None) -> ForwardResult:
        snap = self._pending
        if snap is None:
            raise RuntimeError("collect with nothing submitted")
        done = self._get(timeout)
        self._pending = None
        b = snap.forward.batch_size
        tokens = self.result["tokens"][:b].clone() if done.sampled else None
        want = snap.return_logits or snap.delay_sample
        logits = self.result["logits"][:b].clone() if want else None
        return ForwardResult(done.seq, tokens, logits, done.forward_s)

    def sample(self, result: ForwardResult, snap: ForwardSnapshot) -> torch.Tensor:
        self._put(Sample(snap.seq))
        self._get(None)
        return self.result["tokens"][: snap.forward.batch_size].clone()

    def forward_done_seq(self) -> int:
        return self.events[FORWARD_DONE].value()

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
        self.proc.join(1)
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
        for s in self.slots:
            s.unlink()
        self._events_st.unlink()
        ipc.remove_prefix(self.prefix)  # whatever the forward process left behind
        self.channel.close()
