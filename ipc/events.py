"""Cross-process ordering events with one API on CPU and GPU.

Every event carries a generation: `record(gen)` marks the point reached by the work
issued so far; `wait(gen)` orders the caller's later work after it (host work on the
CPU, the current stream's work on a GPU); `synchronize(gen)` blocks the host until the
work before the record is complete; `query(gen)` asks without blocking; `flush()`
publishes records that only become visible once complete (a no-op for most kinds).
Generations of one event only grow.

On the CPU an event is a slot in a shared int64 table (`ShmEvent`): `record(gen)`
publishes the generation, `wait(gen)` blocks until the slot has reached it. The same
calls map onto interprocess CUDA events (`ipc.cuda.CudaGenEvent`, `HostFencedEvent`),
so ordering logic written against this API is exercised by CPU tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch


class EventTimeout(TimeoutError):
    pass


class EventAbandoned(RuntimeError):
    """The process that would record the event is gone."""


class GenEvent(Protocol):
    name: str

    def record(self, gen: int) -> None: ...

    def wait(
        self, gen: int, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> None: ...

    def synchronize(
        self, gen: int, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> None: ...

    def query(self, gen: int) -> bool: ...

    def flush(self) -> None: ...


class ShmEvent:
    """One generation counter: a one-element view of a shared int64 tensor."""

    __slots__ = ("_cell", "name")

    def __init__(self, cell: torch.Tensor, name: str = "event"):
        self._cell, self.name = cell, name

    def record(self, gen: int) -> None:
        self._cell.fill_(gen)

    def value(self) -> int:
        return int(self._cell.item())

    def query(self, gen: int) -> bool:
        return self.value() >= gen

    def wait(
        self,
        gen: int,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Block until the event reached `gen`; spin briefly, then sleep in short steps."""
        poll_until(lambda: self.query(gen), f"{self.name} generation {gen}", timeout, alive)

    synchronize = wait

    def flush(self) -> None:
        pass


def poll_until(
    done: Callable[[], bool],
    what: str,
    timeout: float | None = None,
    alive: Callable[[], bool] | None = None,
    max_sleep: float = 1e-3,
) -> None:
    """Return once `done()`; raise EventTimeout after `timeout` s, EventAbandoned when
    `alive()` turns false first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    sleep = 0.0
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise EventTimeout(f"waited {timeout}s for {what}")
        if alive is not None and not alive():
            raise EventAbandoned(f"peer died while waiting for {what}")
        time.sleep(sleep)
        sleep = min(sleep * 2 or 1e-5, max_sleep)
