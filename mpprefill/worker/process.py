"""ProcessWorker: the scheduler's side of the forward process."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterator

import torch

import ipc
from ipc.events import EventAbandoned, EventTimeout
from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.model.loader import config_from_args
from mpprefill.worker.api import ForwardInput, ForwardResult, Worker, WorkerDied, sleep_until_ns
from mpprefill.worker.build import num_kv_slots, swa_slots
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import (
    NUM_EVENTS,
    NUM_SLOTS,
    SchedulerOrder,
    forward_gen,
    make_events,
    sample_gen,
)
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.forward_process import NUM_RESULT_SLOTS, WorkerSetup, worker_main
from mpprefill.worker.hooks import DeviceHooks
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.staging import make_staging, staging_specs

TAG = "mpp"
START_TIMEOUT = 300.0


class ProcessWorker(Worker):
    """Spawns the forward process; inputs travel through two shared staging slots, results
    through two result slots (forward N uses slot N % 2 of each)."""

    max_in_flight = 2

    def __init__(self, args: ServerArgs, hooks: DeviceHooks | None = None):
        ipc.sweep_stale(TAG)
        self.args = args
        self.plan = DevicePlan.of(args.device, args.staging)
        self.prefix = ipc.new_prefix(TAG)
        self.max_reqs = args.max_running_requests
        self._pending: deque[ForwardInput] = deque()
        self._kv: KVCache | None = None
        with contextlib.ExitStack() as undo:  # a start that fails leaves nothing behind
            undo.callback(ipc.remove_prefix, self.prefix)
            self._start(args, hooks, undo)
            self._attach(self._get(START_TIMEOUT))
            undo.pop_all()

    def _start(self, args: ServerArgs, hooks: DeviceHooks | None, undo: contextlib.ExitStack):
        self.staging = make_staging(_specs(args, config_from_args(args)), self.prefix, self.plan)
        undo.callback(self.staging.unlink)
        self._events_st = ipc.SharedTensor.create((NUM_EVENTS,), torch.int64, self.prefix)
        undo.callback(self._events_st.unlink)
        events, cuda_events = make_events(self.plan, "scheduler", self._events_st.tensor)
        # Requests (Submit, Sample, Exit) one way, replies the other: each side serves
        # its receiving mailbox on a thread of its own (see mailboxes.py).
        self.requests = ipc.Channel(ipc.ipc_endpoint(f"fw-{self.prefix}-req"), bind=True)
        undo.callback(_drop_channel, self.requests)
        self.replies = ipc.Channel(ipc.ipc_endpoint(f"fw-{self.prefix}-rep"), bind=True)
        undo.callback(_drop_channel, self.replies)
        setup = WorkerSetup.of(
            dataclasses.asdict(args),
            self.plan,
            self.prefix,
            self._events_st.handle,
            cuda_events or None,
            self.staging.handles,
            self.max_reqs,
            hooks or DeviceHooks.from_env(),
        )
        self.proc = mp.get_context("spawn").Process(
            target=worker_main,
            name="mpprefill-forward",
            daemon=True,
            args=(setup, (self.requests.endpoint, self.replies.endpoint), os.getpid()),
        )
        self.proc.start()
        undo.callback(_stop_process, self.proc)
        self.requests.set_peer(self.proc.pid)
        self.replies.set_peer(self.proc.pid)
        self.order = SchedulerOrder(events, alive=self.proc.is_alive)
        self.kv_fence = KVWriteFence(
            args.num_pages, args.page_size, self.order.kv_written, self.order.kv_written_query
        )

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
                num_kv_slots(self.args),
                buffer=ipc.open_handle(self._ready.kv),
                num_swa_slots=swa_slots(self.args),
            )
        return self._kv

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def death(self) -> str | None:
        return None if self.proc.is_alive() else self._death()

    def submit(self, inp: ForwardInput) -> None:
        self._check_room(self._pending)
        slot = inp.seq % NUM_SLOTS
        with self._events():
            counts = self.staging.write(slot, inp.seq, inp.forward, inp.sampling, self.order)
        self.kv_fence.note_writes(inp.seq, inp.forward.out_cache_loc)
        n_tok, n_req, n_kv = counts
        self._put(Submit(inp.seq, slot, n_tok, n_req, n_kv, inp.delay_sample, inp.return_logits))
        self._pending.append(inp)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if not self._pending:
            raise RuntimeError("collect with nothing submitted")
        inp = self._pending[0]
        done = self._get(timeout)
        if done.seq != inp.seq:
            raise WorkerDied(f"forward process answered {done.seq}, expected {inp.seq}")
        sleep_until_ns(done.end_ns)  # the device's own finish time, where it knows it
        with self._events():
            self.order.before_result(forward_gen(done.seq), timeout)
        self._pending.popleft()
        self._note_collected(inp)
        b = inp.batch_size
        row = inp.seq % NUM_RESULT_SLOTS
        tokens = self.result["tokens"][row, :b].clone() if done.sampled else None
        want = inp.return_logits or inp.delay_sample
        logits = self.result["logits"][row, :b].clone() if want else None
        return ForwardResult(
            done.seq, tokens, logits, done.forward_s, done.start_ns, done.end_ns, done.device_s
        )

    def sample(self, inp: ForwardInput, timeout: float | None = None) -> torch.Tensor:
        self._check_sample(inp, self._pending)
        self._put(Sample(inp.seq))
        self._get(timeout)
        with self._events():
            self.order.before_result(sample_gen(inp.seq), timeout)
        row = inp.seq % NUM_RESULT_SLOTS
        return self.result["tokens"][row, : inp.batch_size].clone()

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
            self.requests.put(msg, timeout=60)
        except ipc.PeerDied:
            raise WorkerDied(self._death()) from None

    def _get(self, timeout: float | None):
        try:
            msg = self.replies.get(timeout)
        except ipc.PeerDied:
            raise WorkerDied(self._death()) from None
        except ipc.MailboxTimeout:
            raise WorkerDied(f"forward process stalled: no reply within {timeout}s") from None
        if isinstance(msg, Failed):
            raise WorkerDied(f"forward process failed: {msg.error}")
        if not isinstance(msg, Done | Ready):
            raise WorkerDied(f"unexpected message from the forward process: {msg!r}")
        return msg

    def _death(self) -> str:
        report = None
        with contextlib.suppress(ipc.MailboxError):  # its last words, if it said any
            report = self.replies.get(timeout=0)
        self.proc.join(1)
        if isinstance(report, Failed):
            return f"forward process failed: {report.error}"
        return f"forward process died (exit code {self.proc.exitcode})"

    @property
    def mailbox_bytes(self) -> int:
        channels = (self.requests, self.replies)
        return sum(ch.bytes_sent + ch.bytes_recv for ch in channels)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(ipc.MailboxError):
                self.requests.put(Exit("close"), timeout=2)
            self.proc.join(5)
        _stop_process(self.proc)
        self.staging.unlink()
        self._events_st.unlink()
        ipc.remove_prefix(self.prefix)  # whatever the forward process left behind
        self.requests.close()
        self.replies.close()

    def kill_now(self) -> None:
        """Kill the forward process, then unlink every segment and the channels' sockets."""
        with contextlib.suppress(Exception):
            _stop_process(self.proc, 1)
            self.close()
        for ch in (self.requests, self.replies):
            ipc.remove_ipc_endpoint(ch.endpoint)


def _stop_process(proc: mp.process.BaseProcess, wait_s: float = 5) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(wait_s)


def _drop_channel(ch: ipc.Channel) -> None:
    ch.close()
    ipc.remove_ipc_endpoint(ch.endpoint)


def _specs(args: ServerArgs, config: ModelConfig):
    """Room for any batch admission can build: at most max_running_requests requests, each
    at most the context length and the KV pool long (validated at admission); new tokens
    within the batch budgets, or one whole prompt when chunking is off."""
    longest = min(args.context_len(config.max_position_embeddings), num_kv_slots(args))
    max_tokens = max(
        args.max_prefill_tokens,
        args.chunked_prefill_size,
        longest if args.chunked_prefill_size == -1 else 0,
    )
    max_kv = args.max_running_requests * longest
    return staging_specs(max_tokens, args.max_running_requests, max_kv, config.has_sliding_layers)
