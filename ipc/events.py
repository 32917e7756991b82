"""Cross-process ordering events with one API on CPU and GPU.

On the CPU an event is a slot in a shared int64 table: `record(gen)` publishes the
generation, `wait(gen)` blocks until the slot has reached it. The same calls map
onto interprocess CUDA events (`ipc.cuda.CudaIpcEvent`), so ordering logic written
against this API is exercised by CPU tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class EventTimeout(TimeoutError):
    pass


class ShmEvent:
    """One generation counter inside a shared int64 tensor (see `ShmEventTable`)."""

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
        if self.query(gen):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        sleep = 0.0
        while not self.query(gen):
            if deadline is not None and time.monotonic() > deadline:
                raise EventTimeout(f"{self.name}: waited {timeout}s for generation {gen}")
            if alive is not None and not alive():
                raise RuntimeError(f"{self.name}: peer died while waiting for generation {gen}")
            time.sleep(sleep)
            sleep = min(sleep * 2 or 1e-5, 1e-3)

    synchronize = wait


class ShmEventTable:
    """A row of events over one shared tensor of int64 generations (all start at 0)."""

    def __init__(self, table: torch.Tensor, names: list[str] | None = None):
        if table.dtype != torch.int64 or table.dim() != 1:
            raise ValueError("event table must be a 1-D int64 tensor")
        names = names or [f"event{i}" for i in range(table.numel())]
        self.events = [ShmEvent(table[i : i + 1], names[i]) for i in range(table.numel())]

    def __getitem__(self, i: int) -> ShmEvent:
        return self.events[i]

    def __len__(self) -> int:
        return len(self.events)
