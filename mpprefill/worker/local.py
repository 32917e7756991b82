"""Workers in the scheduler's process: inline (normal, overlap) and a forward thread.

Where the runner's device finishes later than its call returns (the emulated
accelerator), `collect` hands the result over at once, and its reader waits for the
device (`ForwardResult.wait_ready`), as the overlap loop does on a GPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from mpprefill.emulation.device import EmulatedStream
from mpprefill.sampling.sampler import Sampled
from mpprefill.streams import HostStream
from mpprefill.worker.api import ForwardInput, ForwardResult, Worker, WorkerDied, sleep_until_ns
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.layers import local_layers
from mpprefill.worker.runner import ForwardRunner


class _LocalWorker(Worker):
    def __init__(self, runner: ForwardRunner, publish_layers: bool = False):
        """`publish_layers`: each forward publishes its per-layer KV completion (on the
        device's time: the emulated clock's, or at once on the CPU)."""
        self.runner = runner
        self.layers = None
        if publish_layers:
            device = runner.device
            stream = HostStream() if device is None else EmulatedStream(device.clock)
            self.layers, self.layer_progress = local_layers(stream, len(runner.model.layers))

    @property
    def kv_cache(self):
        return self.runner.kv

    def _run(self, inp: ForwardInput) -> ForwardResult:
        on_layer = None if self.layers is None else self.layers.hook(inp.seq)
        return ForwardResult(inp.seq, *self.runner.forward(inp, on_layer))

    def sample(self, inp: ForwardInput, timeout: float | None = None) -> Sampled:
        self._check_sample(inp, self._in_flight())
        return self.runner.sample(self._last_logits, inp.sampling)

    def _in_flight(self) -> list[ForwardInput]:
        raise NotImplementedError

    def _collected(self, inp: ForwardInput, result: ForwardResult) -> ForwardResult:
        self._last_logits = result.logits  # for a deferred sample
        self._note_collected(inp)
        return result


class InlineWorker(_LocalWorker):
    """run_batch on the scheduler thread: the forward runs inside collect()."""

    def __init__(self, runner: ForwardRunner, publish_layers: bool = False):
        super().__init__(runner, publish_layers)
        self._pending: ForwardInput | None = None

    def submit(self, inp: ForwardInput) -> None:
        if self._pending is not None:
            raise RuntimeError("submit before the previous forward was collected")
        self._pending = inp

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if self._pending is None:
            raise RuntimeError("collect with nothing submitted")
        inp = self._pending
        self._pending = None
        return self._collected(inp, self._run(inp))

    def _in_flight(self) -> list[ForwardInput]:
        return [] if self._pending is None else [self._pending]


class ThreadWorker(_LocalWorker):
    """A forward thread with an input and an output queue of capacity one each: one
    forward runs while the next waits in the input queue.

    With a page size it keeps a KV write fence: the scheduler thread writes KV pages too
    (host-store loads) while the forward thread runs, and may only touch pages no forward
    still writes.
    """

    max_in_flight = 2

    def __init__(
        self, runner: ForwardRunner, page_size: int | None = None, publish_layers: bool = False
    ):
        super().__init__(runner, publish_layers)
        self._in: queue.Queue = queue.Queue(maxsize=self.max_in_flight)
        self._out: queue.Queue = queue.Queue(maxsize=1)
        self._pending: deque[ForwardInput] = deque()
        self._done_seq = 0
        self._done_at: dict[int, int] = {}  # seq -> when its device work ends (clock_ns)
        self._done_cv = threading.Condition()
        if page_size is not None:
            num_pages = runner.kv.num_slots // page_size
            self.kv_fence = KVWriteFence(num_pages, page_size, self._wait_written, self._written)
        self._thread = threading.Thread(target=self._loop, name="forward", daemon=True)
        self._thread.start()

    def submit(self, inp: ForwardInput) -> None:
        self._check_room(self._pending)
        if self.kv_fence is not None:
            self.kv_fence.note_writes(inp.seq, inp.forward.out_cache_loc)
        self._in.put_nowait(inp)
        self._pending.append(inp)

    def death(self) -> str | None:
        return None if self._thread.is_alive() else "forward thread exited"

    def _written(self, seq: int) -> bool:
        with self._done_cv:
            if self._done_seq < seq:
                return False
            return self._done_at.get(seq, 0) / 1e9 <= time.monotonic()

    def _wait_written(self, seq: int) -> None:
        with self._done_cv:
            while self._done_seq < seq:
                if not self._done_cv.wait(0.1) and not self._thread.is_alive():
                    raise WorkerDied("forward thread exited")
            end_ns = self._done_at.get(seq, 0)
        sleep_until_ns(end_ns)

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
                    seq = self._pending[0].seq
                    raise WorkerDied(f"forward {seq} not done within {timeout}s") from None
        inp = self._pending.popleft()
        if isinstance(item, BaseException):
            raise WorkerDied(f"forward failed: {item!r}") from item
        return self._collected(inp, item)

    def _in_flight(self) -> list[ForwardInput]:
        return list(self._pending)

    def _loop(self) -> None:
        while (inp := self._in.get()) is not None:
            try:
                result = self._run(inp)
                end_ns = result.end_ns
            except BaseException as e:  # handed to the scheduler, which decides
                result = e
                end_ns = 0
            with self._done_cv:  # its KV writes are issued, failed or not
                self._done_seq = max(self._done_seq, inp.seq)
                self._done_at[inp.seq] = end_ns
                self._done_at.pop(inp.seq - 8, None)
                self._done_cv.notify_all()
            self._out.put(result)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._in.put(None, timeout=5)
            except queue.Full:
                return
            self._thread.join(5)
