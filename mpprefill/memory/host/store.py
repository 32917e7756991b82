"""HostKVStore: a host-memory tier of KV pages under the device prefix cache.

Pages are written asynchronously: `reserve` takes host pages for the pages of a prompt the
store lacks (evicting least recently used ones if needed) and indexes them as writes in
flight; `write` hands the copy of their device KV to the copy thread (`HostCopier`), which
gathers and scatters it; `retire`, on the scheduler thread, marks finished copies ready.
Only ready pages are matched, loaded or evicted. `load` is a copy on the same thread: the
caller waits for it before anything reads the device pages it fills.

    state of a host page   free --reserve--> in flight --retire--> ready --evict--> free
                                                                 ready --flush--> free

With sliding-window (SWA) layers the store has a second pool for their KV. An entry takes
an SWA page only when it is part of a checkpoint (`reserve_swa`): the window of SWA KV
before a prefix end, which a later match that stops there reads. Its SWA copy is in flight
and retired the same way; an entry leaves (and frees both pages) only once both are ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch
from torch import Tensor

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.host.copier import HostCopier, HostLink, SlotCopy
from mpprefill.memory.host.index import HostPage, HostPageIndex
from mpprefill.memory.host.writeback import WritebackBuffers
from mpprefill.memory.kv_cache import KVCache


class Reservation(NamedTuple):
    first_page: int  # page of the prompt where the reserved run starts
    host_slots: Tensor  # slots of the reserved pages, in prompt order
    entries: list[HostPage]
    chain: list[HostPage]  # every entry of the prompt's pages now held, reserved ones too


class PoolWrite(NamedTuple):
    """Device slots of one pool to copy into host slots of the store's matching pool."""

    device_slots: Tensor
    host_slots: Tensor


class _Write(NamedTuple):
    future: Future
    entries: list[HostPage]
    swa_entries: list[HostPage]


def _buffers(pool: Tensor) -> WritebackBuffers:
    """Staging buffers for copies of a pool [planes, L, slots, H, D]: K and V, or a latent
    pool's one plane of rows."""
    planes, layers, _, heads, dim = pool.shape
    return WritebackBuffers(layers, heads, dim, pool.dtype, planes)


def _host_pool(pool: Tensor, num_slots: int) -> KVCache:
    """A zeroed host KVCache shaped like a device pool [planes, L, slots, H, D] (K and V,
    or one latent plane), num_slots long."""
    planes, layers, _, heads, dim = pool.shape
    latent = planes == 1
    pin = pool.device.type == "cuda"
    shape = KVCache.shape(layers, num_slots, heads, dim, latent)
    # NOTE: zeroed now so the copy thread never first-touches (page-faults) host memory.
    buffer = torch.zeros(shape, dtype=pool.dtype, pin_memory=pin)
    return KVCache(layers, num_slots, heads, dim, pool.dtype, buffer=buffer, latent=latent)


class HostKVStore:
    """Capacity `num_tokens` (rounded down to pages) of KV shaped like `like`, on the host:
    K and V, or a latent pool's rows (multi-head latent attention).

    With SWA layers in `like`, the SWA pool has as many pages as the full one, so every
    entry can hold a checkpoint page and only whole entries are ever evicted. `link`: the
    emulated accelerator's host link, which each copy also waits for.
    """

    def __init__(
        self, num_tokens: int, page_size: int, like: KVCache, link: HostLink | None = None
    ) -> None:
        num_pages = num_tokens // page_size
        if num_pages <= 0:
            raise ValueError(f"host store of {num_tokens} tokens holds no page of {page_size}")
        self.page_size = page_size
        self.pages = PagedTokenAllocator(num_pages, page_size)
        self.index = HostPageIndex(page_size)
        self.kv = _host_pool(like.buffer, num_pages * page_size)
        # NOTE: a set of buffers per copy lane: each is taken and given by its thread only
        self.buffers = _buffers(like.buffer)
        self.load_buffers = _buffers(like.buffer)
        self.swa_kv: KVCache | None = None
        self.swa_pages: PagedTokenAllocator | None = None
        if like.swa_buffer is not None:
            self.swa_kv = _host_pool(like.swa_buffer, num_pages * page_size)
            self.swa_pages = PagedTokenAllocator(num_pages, page_size)
            self.swa_buffers = _buffers(like.swa_buffer)
            self.swa_load_buffers = _buffers(like.swa_buffer)
        self.copier = HostCopier(like.device, link)
        self._writes: deque[_Write] = deque()

    @property
    def has_swa(self) -> bool:
        return self.swa_kv is not None

    @property
    def writes_in_flight(self) -> int:
        return len(self._writes)

    def match(self, token_ids: Sequence[int]) -> list[HostPage]:
        """Ready entries of the leading whole pages of token_ids."""
        return self.index.walk(token_ids, ready_only=True)

    def slots_of(self, entries: list[HostPage]) -> Tensor:
        pages = torch.tensor([e.page for e in entries], dtype=torch.int64)
        return self.pages.slots_of(pages)

    def swa_slots_of(self, entries: list[HostPage]) -> Tensor:
        if any(e.swa_page < 0 for e in entries):
            raise ValueError("an entry without an SWA page")
        pages = torch.tensor([e.swa_page for e in entries], dtype=torch.int64)
        return self.pages.slots_of(pages)

    def reserve(self, token_ids: Sequence[int]) -> Reservation:
        """Index the whole pages of token_ids the store lacks as writes in flight.

        As many as fit, in prompt order; the caller must `write` their KV.
        """
        held = self.index.walk(token_ids, ready_only=False)
        want = len(token_ids) // self.page_size - len(held)
        if want > self.pages.num_free_pages:
            keep = frozenset(e.id for e in held)
            self._free(self.index.evict(want - self.pages.num_free_pages, keep))
        take = min(want, self.pages.num_free_pages)
        pages = self.pages.alloc_pages(take)
        parent, entries, ps = (held[-1] if held else self.index.root), [], self.page_size
        for i, page in enumerate(pages.tolist(), start=len(held)):
            parent = self.index.add(parent, token_ids[i * ps : (i + 1) * ps], page)
            entries.append(parent)
        return Reservation(len(held), self.pages.slots_of(pages), entries, held + entries)

    def reserve_swa(self, entries: list[HostPage]) -> tuple[Tensor, list[HostPage]]:
        """SWA pages for those of entries that lack one, as writes in flight: (their host
        SWA slots, those entries); the caller must `write` their SWA KV."""
        if self.swa_pages is None:
            raise ValueError("this store has no SWA pool")
        need = [e for e in entries if e.swa_page < 0]
        pages = self.swa_pages.alloc_pages(len(need))
        if pages is None:  # NOTE: one SWA page per entry at most: never short
            raise RuntimeError(f"host SWA pool short of {len(need)} pages")
        for entry, page in zip(need, pages.tolist(), strict=True):
            entry.swa_page, entry.swa_ready = page, False
        return self.swa_pages.slots_of(pages), need

    def _free(self, entries: list[HostPage]) -> None:
        if not entries:
            return
        self.pages.release_pages(torch.tensor(sorted(e.page for e in entries)))
        swa = sorted(e.swa_page for e in entries if e.swa_page >= 0)
        if swa:
            self.swa_pages.release_pages(torch.tensor(swa))

    def write(
        self,
        device_kv: KVCache,
        full: PoolWrite,
        entries: list[HostPage],
        swa: PoolWrite | None = None,
        swa_entries: list[HostPage] = (),
    ) -> Future | None:
        """Copy the device slots' KV into the host slots, one gather and one scatter per
        pool, on the copy thread. The device slots must stay unchanged until the returned
        future is done (the caller holds them); None when there is nothing to write."""
        if not entries and not swa_entries:
            return None
        ps = self.page_size
        copies = [SlotCopy(device_kv.buffer, full.device_slots, self.kv.buffer, full.host_slots,
                           self.buffers, ps)]  # fmt: skip
        if swa is not None and len(swa.device_slots):
            copies.append(SlotCopy(device_kv.swa_buffer, swa.device_slots, self.swa_kv.buffer,
                                   swa.host_slots, self.swa_buffers, ps))  # fmt: skip
        future = self.copier.write(copies)
        self._writes.append(_Write(future, list(entries), list(swa_entries)))
        return future

    def retire(self, wait: bool = False) -> int:
        """Mark finished copies ready, oldest first; with wait, all of them. Tokens retired
        (full pages; SWA checkpoint pages are not counted)."""
        done = 0
        while self._writes and (wait or self._writes[0].future.done()):
            write = self._writes.popleft()
            write.future.result()  # a failed copy is a bug: raise it on the scheduler thread
            for entry in write.entries:
                self.index.set_ready(entry)
            for entry in write.swa_entries:
                self.index.set_swa_ready(entry)
            done += len(write.entries) * self.page_size
        return done

    def load(
        self,
        entries: list[HostPage],
        device_kv: KVCache,
        device_slots: Tensor,
        swa_entries: list[HostPage] = (),
        swa_device_slots: Tensor | None = None,
        before: Callable[[], None] | None = None,
    ) -> Future:
        """Copy ready pages into device slots (and the SWA KV of swa_entries into device SWA
        slots) on the copy thread, after `before` (the KV write fence). Nothing may read
        those device slots before the returned future is done.

        NOTE: a later write-back that reuses one of these host pages (after an eviction)
        writes it only after this load read it (the copier's lanes keep that order).
        """
        ps = self.page_size
        copies = []
        if len(entries):
            copies.append(SlotCopy(self.kv.buffer, self.slots_of(entries), device_kv.buffer,
                                   device_slots, self.load_buffers, ps))  # fmt: skip
        if len(swa_entries):
            copies.append(SlotCopy(self.swa_kv.buffer, self.swa_slots_of(swa_entries),
                                   device_kv.swa_buffer, swa_device_slots,
                                   self.swa_load_buffers, ps))  # fmt: skip
        return self.copier.load(copies, before)

    def flush(self) -> int:
        """Drop every page (SWA checkpoints too), once the copies in flight have run (a load
        reading a page is done with it); the caller retires its writes first. Tokens
        dropped (full pages)."""
        if self._writes:
            raise RuntimeError(f"flush with {len(self._writes)} write-backs not retired")
        self.copier.drain()
        dropped = self.index.clear()
        self._free(dropped)
        return len(dropped) * self.page_size

    def close(self) -> None:
        try:
            self.retire(wait=True)
        finally:
            self.copier.close()

    def check(self) -> None:
        """free + held == capacity in each pool, no host page twice, in-flight writes are
        the unready."""
        self.pages.check()
        self.index.check()
        entries = list(self.index.entries())
        held = [e.page for e in entries]
        assert len(set(held)) == len(held), "host store: a page is held twice"
        free = self.pages.num_free_pages
        assert free + len(held) == self.pages.num_pages, (
            f"host store: free {free} + held {len(held)} != {self.pages.num_pages} pages"
        )
        assert self.pages.is_held(self.slots_of(entries)), "held page is free"
        in_flight = {e.id for w in self._writes for e in w.entries}
        unready = {e.id for e in entries if not e.ready}
        assert in_flight == unready, "host store: unready pages are not the writes in flight"
        swa = [e for e in entries if e.swa_page >= 0]
        swa_in_flight = {e.id for w in self._writes for e in w.swa_entries}
        assert swa_in_flight == {e.id for e in swa if not e.swa_ready}, (
            "host store: unready SWA pages are not the SWA writes in flight"
        )
        if self.swa_pages is None:
            assert not swa, "host store: an SWA page without an SWA pool"
            return
        self.swa_pages.check()
        pages = [e.swa_page for e in swa]
        assert len(set(pages)) == len(pages), "host store: an SWA page is held twice"
        assert self.swa_pages.num_free_pages + len(pages) == self.swa_pages.num_pages, (
            "host store: SWA pages leaked"
        )

    def __repr__(self) -> str:
        return (
            f"HostKVStore(held={len(self.index)}/{self.pages.num_pages} pages, "
            f"writes={len(self._writes)}, page_size={self.page_size})"
        )
