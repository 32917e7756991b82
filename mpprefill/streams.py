"""Streams: where a worker issues its device work and records events on it.

`HostStream` is the CPU's (work runs at once, on the calling thread); `CudaStream` one
CUDA stream's. The emulated accelerator's stream (`mpprefill.emulation.device`) is a
HostStream whose events fire on its clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from ipc.events import GenEvent

T = TypeVar("T")
CLOCK_HZ = 1.5e9  # SM cycles per second assumed by device-side test sleeps


class HostStream:
    """The CPU "device": issued work runs at once, on the calling thread."""

    # Whether issued work runs elsewhere and may fail later (then `check` raises it).
    runs_elsewhere = False
    error: BaseException | None = None  # what issued work that ran elsewhere raised

    def run(self, fn: Callable[[], T]) -> T | None:
        """Issue `fn`; its value where it ran at once (None where it runs later)."""
        return fn()

    def record(self, event: GenEvent, gen: int) -> None:
        """Record `event` once the work issued so far is complete."""
        event.record(gen)

    def check(self) -> None:
        """Raise what issued work raised (work that ran later, elsewhere)."""
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Return once every issued piece of work has run."""

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        yield


class CudaStream(HostStream):
    """Issued work is enqueued on one CUDA stream; events record on it. `lag` (a test
    hook) puts a device-side sleep of about that many seconds before each piece."""

    def __init__(self, lag: float = 0.0) -> None:
        self.stream = torch.cuda.Stream()
        self.cycles = int(lag * CLOCK_HZ)

    def run(self, fn: Callable[[], T]) -> T | None:
        with torch.cuda.stream(self.stream):
            if self.cycles:
                torch.cuda._sleep(self.cycles)
            return fn()

    def record(self, event: GenEvent, gen: int) -> None:
        with torch.cuda.stream(self.stream):
            event.record(gen)

    def drain(self) -> None:
        self.stream.synchronize()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        with torch.cuda.stream(self.stream):
            yield
