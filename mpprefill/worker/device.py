"""What a device implies for the forward process: staging, event kinds, the stream.

| device | staging  | slots live in        | scheduler events | worker events (it records) |
|--------|----------|----------------------|------------------|----------------------------|
| cpu    | shm      | POSIX shm            | ShmEvent         | ShmEvent                   |
| cuda   | pinned   | shm, page-locked     | ShmEvent         | HostFencedEvent            |
| cuda   | cuda-ipc | device (CUDA IPC)    | CudaGenEvent     | CudaGenEvent               |

Everything else (which event is waited on before what) is the same on every row; see
`events.py`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ipc.events import GenEvent

T = TypeVar("T")
CLOCK_HZ = 1.5e9  # SM cycles per second assumed by device-side test sleeps
_MEMORY_PROBE = (
    "import json, sys, torch; print(json.dumps([torch.cuda.mem_get_info(d) for d in sys.argv[1:]]))"
)


@dataclass(frozen=True)  # NOTE: no slots: it crosses spawn by pickle, also on Python 3.10
class DevicePlan:
    device: str  # "cpu" | "cuda" (an emulated accelerator computes on the CPU)
    staging: str  # "shm" | "pinned" | "cuda-ipc"

    def __post_init__(self):
        ok = (self.device, self.staging) in (
            ("cpu", "shm"),
            ("cuda", "pinned"),
            ("cuda", "cuda-ipc"),
        )
        if not ok:
            raise ValueError(f"no staging {self.staging!r} on device {self.device!r}")

    @classmethod
    def of(cls, device: str, staging: str) -> DevicePlan:
        """The plan for --device and --staging; a CPU worker always stages through shm."""
        kind = "cpu" if device == "emulated" else torch.device(device).type
        return cls("cpu", "shm") if kind == "cpu" else cls(kind, staging)

    @property
    def pin_host_buffers(self) -> bool:
        """Page-lock the shared host buffers the worker copies from and to."""
        return self.device == "cuda"

    def event_kind(self, side: str, recorder: str) -> str:
        """The kind of an event that `recorder` records, as held by `side` (each one of
        "scheduler" or "worker")."""
        if self.staging == "cuda-ipc":
            return "cuda"
        if self.device == "cuda" and side == recorder == "worker":
            return "fenced"
        return "shm"


def device_memory(devices: Sequence[str], timeout: float = 120.0) -> tuple[int, int]:
    """(free, total) bytes of the CUDA device among `devices` with the least free memory.
    Asked in a child process: a CUDA context made here would stay in this (the
    scheduler's) process, holding device memory that pinned staging never needs."""
    cmd = [sys.executable, "-c", _MEMORY_PROBE, *devices]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        why = done.stderr.strip()[-500:]
        raise RuntimeError(f"could not read the free memory of {', '.join(devices)}: {why}")
    pairs = json.loads(done.stdout.strip().splitlines()[-1])
    free, total = min(pairs)
    return int(free), int(total)


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
