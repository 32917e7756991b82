"""What a device implies for the forward process: staging and event kinds.

| device | staging  | slots live in        | scheduler events | worker events (it records) |
|--------|----------|----------------------|------------------|----------------------------|
| cpu    | shm      | POSIX shm            | ShmEvent         | ShmEvent                   |
| cuda   | pinned   | shm, page-locked     | ShmEvent         | HostFencedEvent            |
| cuda   | cuda-ipc | device (CUDA IPC)    | CudaGenEvent     | CudaGenEvent               |

Everything else (which event is waited on before what) is the same on every row; see
`events.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    def of(cls, torch_device: str, staging: str) -> DevicePlan:
        """The plan for the device the tensors live on and --staging; a CPU worker always
        stages through shm."""
        kind = torch.device(torch_device).type
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
