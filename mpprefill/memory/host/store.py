"""HostKVStore: a host-memory tier of KV pages under the device prefix cache.

Pages are written asynchronously: `reserve` takes host pages for the pages of a prompt the
store lacks (evicting least recently used ones if needed) and indexes them as writes in
flight; `write` gathers their device KV into a write-back buffer and hands it to a copy
thread; `retire`, on the scheduler thread, marks finished copies ready. Only ready pages
are matched, loaded or evicted.

    state of a host page   free --reserve--> in flight --retire--> ready --evict--> free
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
from torch import Tensor

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.host.index import HostPage, HostPageIndex
from mpprefill.memory.host.writeback import WritebackBuffers
from mpprefill.memory.kv_cache import KVCache


class Reservation(NamedTuple):
    first_page: int  # page of the prompt where the reserved run starts
    host_slots: Tensor  # slots of the reserved pages, in prompt order
    entries: list[HostPage]


class _Write(NamedTuple):
    future: Future
    entries: list[HostPage]
    buffer: Tensor  # the write-back buffer it reads, reused once it retires


class HostKVStore:
    """Capacity `num_tokens` (rounded down to pages) of KV shaped like `like`, on the host."""

    def __init__(self, num_tokens: int, page_size: int, like: KVCache) -> None:
        num_pages = num_tokens // page_size
        if num_pages <= 0:
            raise ValueError(f"host store of {num_tokens} tokens holds no page of {page_size}")
        self.page_size = page_size
        self.pages = PagedTokenAllocator(num_pages, page_size)
        self.index = HostPageIndex(page_size)
        _, layers, _, heads, dim = like.buffer.shape
        shape = KVCache.shape(layers, num_pages * page_size, heads, dim)
        pin = like.device.type == "cuda"
        # NOTE: zeroed now so the copy thread never first-touches (page-faults) host memory.
        buffer = torch.zeros(shape, dtype=like.dtype, pin_memory=pin)
        self.kv = KVCache(layers, num_pages * page_size, heads, dim, like.dtype, buffer=buffer)
        self.buffers = WritebackBuffers(layers, heads, dim, like.dtype)
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="host-kv-copy")
        self._writes: deque[_Write] = deque()

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    def held_tokens(self) -> int:
        return len(self.index) * self.page_size

    def match(self, token_ids: Sequence[int]) -> list[HostPage]:
        """Ready entries of the leading whole pages of token_ids."""
        return self.index.walk(token_ids, ready_only=True)

    def slots_of(self, entries: list[HostPage]) -> Tensor:
        pages = torch.tensor([e.page for e in entries], dtype=torch.int64)
        return self.pages.slots_of(pages)

    def reserve(self, token_ids: Sequence[int]) -> Reservation:
        """Index the whole pages of token_ids the store lacks as writes in flight.

        As many as fit, in prompt order; the caller must `write` their KV.
        """
        held = self.index.walk(token_ids, ready_only=False)
        want = len(token_ids) // self.page_size - len(held)
        if want > self.pages.num_free_pages:
            keep = frozenset(e.id for e in held)
            freed = self.index.evict(want - self.pages.num_free_pages, keep)
            if freed:
                self.pages.free(self.pages.slots_of(torch.tensor(freed, dtype=torch.int64)))
        take = min(want, self.pages.num_free_pages)
        pages = self.pages.alloc_pages(take)
        parent, entries, ps = (held[-1] if held else self.index.root), [], self.page_size
        for i, page in enumerate(pages.tolist(), start=len(held)):
            parent = self.index.add(parent, token_ids[i * ps : (i + 1) * ps], page)
            entries.append(parent)
        return Reservation(len(held), self.pages.slots_of(pages), entries)

    def write(
        self,
        device_kv: KVCache,
        device_slots: Tensor,
        host_slots: Tensor,
        entries: list[HostPage],
    ) -> None:
        """Gather device_slots' KV into a write-back buffer (now) and copy it into host_slots
        with one copy (on the copy thread). The device slots may be reused once this returns."""
        if not entries:
            return
        buf = self.buffers.take(len(device_slots), device_kv.device)
        gathered = self.buffers.view(buf, len(device_slots))
        torch.index_select(device_kv.buffer, 2, device_slots.to(device_kv.device), out=gathered)
        if gathered.is_cuda:
            torch.cuda.current_stream(gathered.device).synchronize()
        future = self.copier.submit(self._copy, gathered, host_slots)
        self._writes.append(_Write(future, entries, buf))

    def _copy(self, gathered: Tensor, host_slots: Tensor) -> None:
        self.kv.buffer.index_copy_(2, host_slots, gathered.to("cpu"))

    def retire(self, wait: bool = False) -> int:
        """Mark finished copies ready, oldest first; with wait, all of them. Tokens retired."""
        done = 0
        while self._writes and (wait or self._writes[0].future.done()):
            write = self._writes.popleft()
            write.future.result()  # a failed copy is a bug: raise it on the scheduler thread
            self.buffers.give(write.buffer)
            for entry in write.entries:
                self.index.set_ready(entry)
            done += len(write.entries) * self.page_size
        return done

    def load(self, entries: list[HostPage], device_kv: KVCache, device_slots: Tensor) -> None:
        """Copy ready pages into device slots; complete when this returns."""
        pages = self.kv.gather(self.slots_of(entries)).to(device_kv.device)
        device_kv.buffer.index_copy_(2, device_slots.to(device_kv.device), pages)
        if device_kv.device.type == "cuda":
            torch.cuda.current_stream(device_kv.device).synchronize()

    def close(self) -> None:
        self.retire(wait=True)
        self.copier.shutdown(wait=True)

    def check(self) -> None:
        """free + held == capacity, no host page twice, in-flight writes are the unready."""
        self.pages.check()
        self.index.check()
        held = [e.page for e in self.index.entries()]
        assert len(set(held)) == len(held), "host store: a page is held twice"
        free = self.pages.num_free_pages
        assert free + len(held) == self.pages.num_pages, (
            f"host store: free {free} + held {len(held)} != {self.pages.num_pages} pages"
        )
        assert self.pages.is_held(self.slots_of(list(self.index.entries()))), "held page is free"
        in_flight = {e.id for w in self._writes for e in w.entries}
        unready = {e.id for e in self.index.entries() if not e.ready}
        assert in_flight == unready, "host store: unready pages are not the writes in flight"

    def __repr__(self) -> str:
        return (
            f"HostKVStore(held={len(self.index)}/{self.pages.num_pages} pages, "
            f"writes={len(self._writes)}, page_size={self.page_size})"
        )
