"""HostCopier: the host tier's copies, on two threads of their own, one per direction.

The scheduler thread only plans a copy (which slots of which pool go where) and hands it
over; a copy thread gathers, moves and scatters, and the scheduler later retires what is
done. Loads (host to device) and write-backs (device to host) each run one at a time in
submission order on their own lane, as a GPU's copy engines move both directions at once;
a load, which the next forward waits for, never queues behind a write-back. Between the
lanes one order holds: a write-back starts only after every load submitted before it, so
a host page that a load reads is rewritten by a later write-back (after an eviction) only
once that load is done. The other way needs nothing: a load reads ready host pages only,
whose write-backs have retired, and fills fresh device pages, which no write-back reads.

    pools          CPU device               CUDA device
    write-back     gather + scatter (host)  gather + D2H on the write lane's stream,
                                            event, then scatter on the host
    load           gather + scatter (host)  gather on the host, H2D + scatter on the
                                            load lane's stream, event

On the emulated accelerator the pools are host memory at a tiny width; each copy then
lasts the time the real model's KV would take over the GPU's host link (`HostLink`),
which starts with the tiny copy and runs beside it (as the emulated forward's own compute
runs beside its clock), so loads and write-backs last what they would on the GPU.

NOTE: torch's copy kernels release the GIL, so on the CPU the threads' copies run beside
the scheduler's Python; on CUDA a thread waits on its stream's event, never the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from mpprefill.memory.host.writeback import WritebackBuffers


class SlotCopy(NamedTuple):
    """Slots src_slots of pool src (a KV pool [planes, L, slots, H, D]) into slots dst_slots of
    pool dst; one of them on the host. `buffers`: staging buffers for this pool's shape.
    Where both slot lists are whole pages of `page_size`, the copy moves pages."""

    src: Tensor
    src_slots: Tensor
    dst: Tensor
    dst_slots: Tensor
    buffers: WritebackBuffers
    page_size: int = 1


def whole_pages(slots: Tensor, page_size: int) -> Tensor | None:
    """The pages of slots when they are whole pages of page_size, each in slot order
    (page p is slots p * page_size ... p * page_size + page_size - 1); else None."""
    if page_size <= 1 or len(slots) % page_size:
        return None
    rows = slots.view(-1, page_size)
    firsts = rows[:, :1]
    if bool((firsts % page_size).any()):
        return None
    if not torch.equal(rows - firsts, torch.arange(page_size).expand_as(rows)):
        return None
    return firsts.view(-1) // page_size


def _by_page(pool: Tensor, page_size: int) -> Tensor:
    """A pool [planes, L, slots, H, D] as [planes * L, pages, page_size * H * D]: a row a page."""
    planes, layers, slots, heads, dim = pool.shape
    return pool.view(planes * layers, slots // page_size, page_size * heads * dim)


def gather(src: Tensor, slots: Tensor, out: Tensor, page_size: int) -> None:
    """out[:, :, i] = src[:, :, slots[i]]; whole pages are moved a page at a time, which
    on the host is many times faster than slot rows of a few hundred bytes."""
    pages = whole_pages(slots, page_size) if src.is_contiguous() else None
    if pages is None:
        torch.index_select(src, 2, slots, out=out)
        return
    torch.index_select(_by_page(src, page_size), 1, pages, out=_by_page(out, page_size))


def scatter(dst: Tensor, slots: Tensor, data: Tensor, page_size: int) -> None:
    """dst[:, :, slots[i]] = data[:, :, i], a page at a time where slots are whole pages."""
    pages = whole_pages(slots, page_size) if dst.is_contiguous() else None
    if pages is None:
        dst.index_copy_(2, slots, data)
        return
    _by_page(dst, page_size).index_copy_(1, pages, _by_page(data, page_size))


class HostLink(Protocol):
    def start(self, num_tokens: int, num_layers: int, to_device: bool) -> Callable[[], None]:
        """Start moving num_tokens tokens' KV of num_layers layers in one direction; the
        call returned blocks until that move is done."""


class HostCopier:
    def __init__(self, device: torch.device, link: HostLink | None = None) -> None:
        self.device = device
        self.link = link
        cuda = device.type == "cuda"
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._write_stream = torch.cuda.Stream(device) if cuda else None
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="host-kv-load")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="host-kv-write")
        self._last_load: Future | None = None  # the write lane's barrier

    def load(self, copies: list[SlotCopy], before: Callable[[], None] | None = None) -> Future:
        """Host-to-device copies, after `before` (a fence wait) and every load submitted
        earlier; the future's result is the seconds the copies took."""
        self._last_load = self._loads.submit(self._run, copies, before, True)
        return self._last_load

    def write(self, copies: list[SlotCopy]) -> Future:
        """Device-to-host copies, after every write-back and every load submitted earlier;
        the future's result is the seconds the copies took."""
        return self._writes.submit(self._run, copies, self._after_loads(), False)

    def _after_loads(self) -> Callable[[], None] | None:
        last = self._last_load
        if last is None or last.done():
            return None
        return lambda: wait([last])  # NOTE: a failed load raises on its own future

    def drain(self) -> None:
        """Block until every copy submitted so far, either lane, has run."""
        wait([self._loads.submit(lambda: None), self._writes.submit(lambda: None)])

    def _run(
        self, copies: list[SlotCopy], before: Callable[[], None] | None, to_device: bool
    ) -> float:
        if before is not None:
            before()
        t0 = time.perf_counter()
        for copy in copies:
            if not len(copy.src_slots):
                continue
            done = None
            if self.link is not None:  # NOTE: its time runs while the copy below does
                done = self.link.start(len(copy.src_slots), copy.src.shape[1], to_device)
            self._copy(copy)
            if done is not None:
                done()
        return time.perf_counter() - t0

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
            gather(c.src, c.src_slots, out, c.page_size)
            scatter(c.dst, c.dst_slots, out, c.page_size)
            c.buffers.give(buf)

    def _device_to_host(self, c: SlotCopy, n: int) -> None:
        """Gather and copy down on the staging stream, then scatter into the host pool."""
        buf = c.buffers.take(n, torch.device("cpu"), pin=True)
        out = c.buffers.view(buf, n)
        with torch.cuda.device(self.device), torch.cuda.stream(self._write_stream):
            gathered = c.src.index_select(2, c.src_slots.to(self.device, non_blocking=True))
            out.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._write_stream)
        done.synchronize()
        scatter(c.dst, c.dst_slots, out, c.page_size)
        c.buffers.give(buf)

    def _host_to_device(self, c: SlotCopy, n: int) -> None:
        """Gather on the host into a pinned buffer, then copy up and scatter on the
        staging stream; complete when its event is."""
        buf = c.buffers.take(n, torch.device("cpu"), pin=True)
        out = c.buffers.view(buf, n)
        gather(c.src, c.src_slots, out, c.page_size)
        with torch.cuda.device(self.device), torch.cuda.stream(self._load_stream):
            up = out.to(self.device, non_blocking=True)
            c.dst.index_copy_(2, c.dst_slots.to(self.device, non_blocking=True), up)
            done = torch.cuda.Event()
            done.record(self._load_stream)
        done.synchronize()  # NOTE: the pinned buffer is reused only after the copy up
        c.buffers.give(buf)

    def close(self) -> None:
        self._loads.shutdown(wait=True)
        self._writes.shutdown(wait=True)
