"""Test hooks that make a forward process behave like a slow asynchronous device.

- `LaggingStream` (MPPREFILL_TEST_SLOW_DEVICE=s, CPU): issued work runs in order on a
  thread, s seconds late, so the worker replies before its forward ran, as a GPU worker
  does. Results and KV pages are then correct only if readers wait on their events. On
  a GPU the same hook puts a device-side sleep before each piece (`device.CudaStream`).
- `LateReads` (MPPREFILL_TEST_SLOW_READS=s): the reads of a staging slot end s seconds
  after the result is out, concurrently with the next forward, as when a device still
  reads the inputs. A rewrite of the slot meanwhile (a missing WAR barrier) is caught
  and reported at the worker's next message. The CUDA variant reads on a side stream.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from mpprefill.model import ForwardBatch
from mpprefill.worker.device import CLOCK_HZ, HostStream

SLOW_READS_ENV = "MPPREFILL_TEST_SLOW_READS"


class LaggingStream(HostStream):
    def __init__(self, lag: float):
        self.lag, self.error = lag, None
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="lagging-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], None]) -> None:
        self.check()
        self._work.put(fn)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        done = threading.Event()
        self._work.put(done.set)
        while not done.wait(0.05):
            self.check()

    def _loop(self) -> None:
        while True:
            fn = self._work.get()
            time.sleep(self.lag)
            try:
                fn()
            except BaseException as e:  # raised on the issuing thread by check()
                self.error = e
                return


def late_reads(device: str) -> LateReads | None:
    delay = float(os.environ.get(SLOW_READS_ENV, "0"))
    if delay <= 0:
        return None
    return CudaLateReads(delay) if device == "cuda" else LateReads(delay)


class LateReads:
    def __init__(self, delay: float):
        self.delay = delay
        self.pending: dict[int, threading.Thread] = {}
        self.violations: list[str] = []

    def release(self, slot: int, seq: int, fb: ForwardBatch, record: Callable[[], None]) -> None:
        """End the reads of `slot` (views `fb`) late, then `record` "reads done"."""
        before = fb.input_ids.clone(), fb.kv_indices.clone()

        def finish() -> None:
            time.sleep(self.delay)
            if not (torch.equal(before[0], fb.input_ids) and torch.equal(before[1], fb.kv_indices)):
                self.violations.append(_violation(slot, seq))
            record()

        t = threading.Thread(target=finish, daemon=True)
        t.start()
        self.pending[slot] = t

    def before_reuse(self, slot: int) -> None:
        """Before `slot` is read again: the earlier reads end first; report violations."""
        t = self.pending.pop(slot, None)
        if t is not None:
            t.join()
        if self.violations:
            raise RuntimeError(self.violations[0])


class CudaLateReads(LateReads):
    """The late reads run on a side stream after a device-side sleep."""

    def __init__(self, delay: float):
        super().__init__(delay)
        self.side = torch.cuda.Stream()
        self.cycles = int(delay * CLOCK_HZ)
        self.checks: dict[int, tuple] = {}

    def release(self, slot: int, seq: int, fb: ForwardBatch, record: Callable[[], None]) -> None:
        before = fb.input_ids.clone(), fb.kv_indices.clone()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
            same = (before[0] == fb.input_ids).all() & (before[1] == fb.kv_indices).all()
            record()
        self.checks[slot] = (seq, same, before)  # `before` lives until the check ran

    def before_reuse(self, slot: int) -> None:
        check = self.checks.pop(slot, None)
        if check is not None and not bool(check[1].item()):
            self.violations.append(_violation(slot, check[0]))
        if self.violations:
            raise RuntimeError(self.violations[0])


def _violation(slot: int, seq: int) -> str:
    return f"staging slot {slot} rewritten while forward {seq} was still reading it"
