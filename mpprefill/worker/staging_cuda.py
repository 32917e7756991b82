"""The CUDA parts of staging: device slots over CUDA IPC, and page-locked host buffers.

cuda-ipc: the scheduler allocates both slots on the device once and shares them through
CUDA IPC; it fills a slot on its own copy stream (after a device-side wait on the slot's
"reads done" event, then records "staged"), so the copies leave the host at once and the
worker's stream waits for them on the device.

pinned: the slots stay in host shared memory; the worker page-locks the segments once,
then copies each batch in asynchronously on its forward stream. The scheduler never
touches CUDA. The result slot (host shared memory) is page-locked the same way.

Default: pinned, pending GPU numbers. A batch's inputs are small (int64 per new token
plus the page-table rows: hundreds of KiB, a few MiB at most, tens of microseconds over
PCIe), and since submit(N+1) follows collect(N) they are copied while the device is idle
either way, so cuda-ipc's separate copy engine buys little. Pinned keeps the scheduler free of a
CUDA context (memory, start-up time, CUDA calls holding its GIL), of CUDA IPC's lifetime
rules (a consumer killed by a signal leaks the block while the producer lives; one open
per process), and of a device-side wait it cannot time out; its cost is one host wait in
the worker per forward, before the reply. cuda-ipc should win only if that wait shows up
as a bubble: gpu_check.sh measures both (submit and collect-wait per batch).
"""

from __future__ import annotations

import logging

import torch

import ipc
from ipc.cuda import pin
from mpprefill.worker.device import CudaStream
from mpprefill.worker.staging import ShmStaging

logger = logging.getLogger(__name__)


class CudaIpcStaging(ShmStaging):
    """Slots in device memory; the scheduler's writes are copies on its copy stream."""

    kind = "cuda-ipc"
    device = "cuda"
    non_blocking = True  # NOTE: from pageable memory the copy returns once it is staged

    def new_stream(self) -> CudaStream:
        return CudaStream()


def pin_segments(handles: list[ipc.TensorHandle]) -> list[torch.Tensor]:
    """Page-lock the whole host segments behind `handles`, once each; returns the pinned
    views (kept by the caller for as long as the mapping lives)."""
    pinned, seen = [], set()
    for h in handles:
        if h.kind != "shm" or h.name in seen:
            continue
        seen.add(h.name)
        whole = ipc.open_handle(ipc.TensorHandle("shm", h.name, "uint8", (h.nbytes,), 0, h.nbytes))
        if pin(whole):
            pinned.append(whole)
        else:
            logger.warning("could not page-lock %s; its copies will be synchronous", h.name)
    return pinned
