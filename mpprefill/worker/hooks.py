"""Test hooks that make a forward process behave like a slow asynchronous device.

They are read from the environment here and nowhere else (`DeviceHooks.from_env`, by the
server's side at spawn), then carried to the forward process in its set-up:

- `slow_device_s` (MPPREFILL_TEST_SLOW_DEVICE): issued work runs `s` seconds late. On the
  CPU (`LaggingStream`) it runs in order on a thread, so the worker replies before its
  forward ran, as a GPU worker does; results and KV pages are then correct only if
  readers wait on their events. On a GPU a device-side sleep goes before each piece.
- `slow_reads_s` (MPPREFILL_TEST_SLOW_READS): the reads of a staging slot end `s` seconds
  after the result is out, concurrently with the next forward, as when a device still
  reads the inputs (`LateReads`). A rewrite of the slot meanwhile (a missing WAR barrier)
  is caught and reported at the worker's next message. The CUDA variant reads on a side
  stream.
- `forward_guard` (MPPREFILL_TEST_FORWARD_GUARD, a directory): every forward runs under
  a `ForwardGuard` (a read of the batch's device tensors fails the forward) and each
  process appends its forwards' torch call counts to a file there.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpprefill.model import ForwardBatch
from mpprefill.streams import CLOCK_HZ, CudaStream, HostStream
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.runner import ForwardRunner

SLOW_DEVICE_ENV = "MPPREFILL_TEST_SLOW_DEVICE"
SLOW_READS_ENV = "MPPREFILL_TEST_SLOW_READS"
FORWARD_GUARD_ENV = "MPPREFILL_TEST_FORWARD_GUARD"


@dataclass(frozen=True)  # NOTE: no slots: it crosses spawn by pickle, also on Python 3.10
class DeviceHooks:
    slow_device_s: float = 0.0
    slow_reads_s: float = 0.0
    forward_guard: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> DeviceHooks:
        env = os.environ if env is None else env
        return cls(
            float(env.get(SLOW_DEVICE_ENV, 0)),
            float(env.get(SLOW_READS_ENV, 0)),
            env.get(FORWARD_GUARD_ENV, ""),
        )

    def guard(self, runner: ForwardRunner) -> None:
        """Put the runner's forwards under the guard, when asked."""
        if self.forward_guard:
            runner.set_guard(self.forward_guard)

    def stream(self, plan: DevicePlan) -> HostStream:
        """The forward stream, lagging when asked."""
        if plan.device == "cuda":
            return CudaStream(self.slow_device_s)
        if self.slow_device_s > 0:
            return LaggingStream(self.slow_device_s)
        return HostStream()

    def late_reads(self, plan: DevicePlan) -> LateReads | None:
        if self.slow_reads_s <= 0:
            return None
        if plan.device == "cuda":
            return CudaLateReads(self.slow_reads_s)
        return LateReads(self.slow_reads_s)


class LaggingStream(HostStream):
    runs_elsewhere = True

    def __init__(self, lag: float):
        self.lag = lag
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="lagging-device", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], None]) -> None:
        self.check()
        self._work.put(fn)

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
