"""Workers in the scheduler's process: inline (normal, overlap) and a forward thread."""

from __future__ import annotations

import queue
import threading
import time

import torch

from mpprefill.worker.base import ForwardResult, ForwardSnapshot, Worker, WorkerDied
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.runner import ForwardRunner


class _LocalWorker(Worker):
    def __init__(self, runner: ForwardRunner):
        self.runner = runner

    @property
    def kv_cache(self):
        return self.runner.kv

    def _run(self, snap: ForwardSnapshot, early_send_prefix: bool) -> ForwardResult:
        if early_send_prefix and self.early_send_hook is not None:
            self.early_send_hook(snap)
        out = self.runner.forward(snap.forward, snap.sampling, snap.delay_sample, snap.seq)
        return ForwardResult(snap.seq, out.next_token_ids, out.logits, out.forward_s)

    def sample(self, result: ForwardResult, snap: ForwardSnapshot) -> torch.Tensor:
        # NOTE: called only after collect(), so the worker is idle here.
        return self.runner.sample(result.logits, snap.sampling)


class InlineWorker(_LocalWorker):
    """run_batch on the scheduler thread: the forward runs inside collect()."""

    kind = "inline"

    def __init__(self, runner: ForwardRunner):
        super().__init__(runner)
        self._pending: tuple[ForwardSnapshot, bool] | None = None

    def submit(self, snap: ForwardSnapshot, early_send_prefix: bool) -> None:
        if self._pending is not None:
            raise RuntimeError("submit before the previous forward was collected")
        self._pending = (snap, early_send_prefix)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if self._pending is None:
            raise RuntimeError("collect with nothing submitted")
        pending, self._pending = self._pending, None
        return self._run(*pending)


class ThreadWorker(_LocalWorker):
    """A forward thread with an input and an output queue of capacity one each.

    With a page size it keeps a KV write fence: the scheduler thread writes KV pages too
    (host-store loads) while the forward thread runs, and may only touch pages no forward
    still writes.
    """

    kind = "thread"

    def __init__(self, runner: ForwardRunner, page_size: int | None = None):
        super().__init__(runner)
        self._in: queue.Queue = queue.Queue(maxsize=1)
        self._out: queue.Queue = queue.Queue(maxsize=1)
        self._pending = False
        self._done_seq, self._done_cv = 0, threading.Condition()
        if page_size is not None:
            num_pages = runner.kv.num_slots // page_size
            self.kv_fence = KVWriteFence(
                num_pages, page_size, self._wait_written, lambda seq: self._done_seq >= seq
            )
        self._thread = threading.Thread(target=self._loop, name="forward", daemon=True)
        self._thread.start()

    def submit(self, snap: ForwardSnapshot, early_send_prefix: bool) -> None:
        if self._pending:
            raise RuntimeError("submit before the previous forward was collected")
        if self.kv_fence is not None:
            self.kv_fence.note_writes(snap.seq, snap.forward.out_cache_loc)
        self._in.put_nowait((snap, early_send_prefix))
        self._pending = True

    def _wait_written(self, seq: int) -> None:
        with self._done_cv:
            while self._done_seq < seq:
                if not self._done_cv.wait(0.1) and not self._thread.is_alive():
                    raise WorkerDied("forward thread exited")

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if not self._pending:
            raise RuntimeError("collect with nothing submitted")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = self._out.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise WorkerDied("forward thread exited") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"forward not done within {timeout}s") from None
        self._pending = False
        if isinstance(item, BaseException):
            raise WorkerDied(f"forward failed: {item!r}") from item
        return item

    def _loop(self) -> None:
        while (item := self._in.get()) is not None:
            try:
                result = self._run(*item)
            except BaseException as e:  # handed to the scheduler, which decides
                result = e
            with self._done_cv:  # its KV writes are over, failed or not
                self._done_seq = max(self._done_seq, item[0].seq)
                self._done_cv.notify_all()
            self._out.put(result)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._in.put(None, timeout=5)
            except queue.Full:
                return
            self._thread.join(5)
