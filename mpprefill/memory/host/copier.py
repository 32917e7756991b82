"""HostCopier: the host tier's copies, in order, on a thread of their own.

The scheduler thread only plans a copy (which slots of which pool go where) and hands it
over; the copy thread gathers, moves and scatters, and the scheduler later retires what
is done. Copies run one at a time in submission order, so a host page that a load reads
is rewritten by a later write-back only after that load, and a device page a load fills
is read by nothing the scheduler issued before it.

    pools          CPU device               CUDA device
    write-back     gather + scatter (host)  gather + D2H on the staging stream, event,
                                            then scatter on the host
    load           gather + scatter (host)  gather on the host, H2D + scatter on the
                                            staging stream, event

NOTE: torch's copy kernels release the GIL, so on the CPU the thread's copies run beside
the scheduler's Python; on CUDA the thread waits on the staging stream's event, never the
scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch import Tensor

from mpprefill.memory.host.writeback import WritebackBuffers


class SlotCopy(NamedTuple):
    """Slots src_slots of pool src (a KV pool [2, L, slots, H, D]) into slots dst_slots of
    pool dst; one of them on the host. `buffers`: staging buffers for this pool's shape."""

    src: Tensor
    src_slots: Tensor
    dst: Tensor
    dst_slots: Tensor
    buffers: WritebackBuffers


class HostCopier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="host-kv-copy")
        self.busy_s = 0.0  # seconds the thread spent copying (read on the scheduler thread)

    def submit(self, copies: list[SlotCopy], before: Callable[[], None] | None = None) -> Future:
        """Run the copies after `before` (a fence wait) and every copy submitted earlier;
        the future's result is the seconds the copies took."""
        return self._thread.submit(self._run, copies, before)

    def submit_call(self, fn: Callable[[], object]) -> Future:
        """Run fn in the copies' order (a test holds the thread with it)."""
        return self._thread.submit(fn)

    def drain(self) -> None:
        """Block until every copy submitted so far has run."""
        self._thread.submit(lambda: None).result()

    def _run(self, copies: list[SlotCopy], before: Callable[[], None] | None) -> float:
        if before is not None:
            before()
        t0 = time.perf_counter()
        for copy in copies:
            if len(copy.src_slots):
                self._copy(copy)
        took = time.perf_counter() - t0
        self.busy_s += took
        return took

    def _copy(self, c: SlotCopy) -> None:
        n = len(c.src_slots)
        host = torch.device("cpu")
        if c.src.device.type == "cuda":
            self._device_to_host(c, n)
        elif c.dst.device.type == "cuda":
            self._host_to_device(c, n)
        else:
            buf = c.buffers.take(n, host)
            out = c.buffers.view(buf, n)
            torch.index_select(c.src, 2, c.src_slots, out=out)
            c.dst.index_copy_(2, c.dst_slots, out)
            c.buffers.give(buf)

    def _device_to_host(self, c: SlotCopy, n: int) -> None:
        """Gather and copy down on the staging stream, then scatter into the host pool."""
        buf = c.buffers.take(n, torch.device("cpu"), pin=True)
        out = c.buffers.view(buf, n)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            gathered = c.src.index_select(2, c.src_slots.to(self.device, non_blocking=True))
            out.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        c.dst.index_copy_(2, c.dst_slots, out)
        c.buffers.give(buf)

    def _host_to_device(self, c: SlotCopy, n: int) -> None:
        """Gather on the host into a pinned buffer, then copy up and scatter on the
        staging stream; complete when its event is."""
        buf = c.buffers.take(n, torch.device("cpu"), pin=True)
        out = c.buffers.view(buf, n)
        torch.index_select(c.src, 2, c.src_slots, out=out)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            up = out.to(self.device, non_blocking=True)
            c.dst.index_copy_(2, c.dst_slots.to(self.device, non_blocking=True), up)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # NOTE: the pinned buffer is reused only after the copy up
        c.buffers.give(buf)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
