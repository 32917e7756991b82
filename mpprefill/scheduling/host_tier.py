"""HostTier: the host KV store wired to the scheduler's radix cache, allocator and KV pool.

Three entry points, all on the scheduler thread:
- `match_prefix` (admission): a device match, extended by loading the ready host pages that
  follow it into fresh device pages, which join the tree before the request locks them.
- `write_back` (result processing): the committed pages of requests whose final chunk just
  finished are written back to host slots: one gather and one copy for the whole set (or
  one per request with batched write-back off).
- `retire` (top of every loop iteration): finished copies become matchable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.host.index import HostPage
from mpprefill.memory.host.store import HostKVStore
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.radix_cache import MatchResult, RadixCache
from mpprefill.scheduling.metrics import SchedulerMetrics
from mpprefill.scheduling.req import Req

if TYPE_CHECKING:
    from mpprefill.config import ServerArgs
    from mpprefill.worker.api import Worker
    from mpprefill.worker.fence import KVWriteFence


def make_host_tier(
    args: ServerArgs,
    tree: RadixCache,
    allocator: PagedTokenAllocator,
    worker: Worker,
    metrics: SchedulerMetrics,
) -> HostTier | None:
    """The host tier --host-store-size asks for, over the worker's KV pool; None when 0."""
    if args.host_store_size <= 0:
        return None
    kv = worker.kv_cache
    store = HostKVStore(args.host_store_size, args.page_size, kv)
    batched = not args.disable_batched_writeback
    return HostTier(store, tree, allocator, kv, batched, metrics, worker.kv_fence)


class WritebackPlan(NamedTuple):
    device_slots: Tensor
    host_slots: Tensor
    entries: list[HostPage]


class HostTier:
    def __init__(
        self,
        store: HostKVStore,
        tree: RadixCache,
        allocator: PagedTokenAllocator,
        kv: KVCache,
        batched_writeback: bool = True,
        metrics: SchedulerMetrics | None = None,
        fence: KVWriteFence | None = None,
    ) -> None:
        self.store = store
        self.tree = tree
        self.allocator = allocator
        self.kv = kv
        self.fence = fence
        self.page_size = store.page_size
        self.batched_writeback = batched_writeback
        self.metrics = metrics or SchedulerMetrics()
        self.writeback_calls = 0  # gathers (each followed by one copy) issued by write_back

    # ---- load on a prefix hit -------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], limit: int, budget: Callable[[], int], partial: bool
    ) -> tuple[MatchResult, int]:
        """The device match, extended by loading the ready host pages that follow it within
        token_ids[:limit]; loaded pages join the tree, unlocked. Also returns how many such
        host pages were left on the host: when fewer than all fit in budget() device pages,
        partial loads what fits, else nothing is loaded."""
        dev = self.tree.match_prefix(token_ids)
        have = len(dev.indices) // self.page_size
        chain = self.store.match(token_ids[:limit])
        if len(chain) <= have:
            return dev, 0
        self.tree.inc_lock_ref(dev.last_node)  # NOTE: the eviction below must not take it
        try:
            n = min(len(chain) - have, max(budget(), 0))
            if n == 0 or (n < len(chain) - have and not partial):
                return dev, len(chain) - have
            self._load(token_ids, dev.indices, chain[have : have + n])
        finally:
            self.tree.dec_lock_ref(dev.last_node)
        return self.tree.match_prefix(token_ids), len(chain) - have - n

    def _load(self, token_ids: Sequence[int], prefix: Tensor, entries: list[HostPage]) -> None:
        slots = self._alloc(len(entries))
        if self.fence is not None:
            # NOTE: freed pages can be handed out while the forward in flight still writes
            # them (a request's duplicate copies); load only once that forward is done
            self.fence.wait_pages(torch.unique(slots // self.page_size))
        self.store.load(entries, self.kv, slots)
        end = len(prefix) + len(slots)
        present = self.tree.insert(token_ids[:end], torch.cat([prefix, slots]))
        self.allocator.free(slots[: max(present - len(prefix), 0)])  # already in the tree
        self.metrics.host_loaded_tokens += end - max(present, len(prefix))

    def _alloc(self, num_pages: int) -> Tensor:
        short = num_pages - self.allocator.num_free_pages
        if short > 0:
            self.tree.evict(short * self.page_size)
        slots = self.allocator.alloc(num_pages * self.page_size)
        if slots is None:
            raise RuntimeError(f"no {num_pages} device pages for a host load within budget")
        return slots

    # ---- write-back of finished requests --------------------------------------------------

    def write_back(self, reqs: list[Req]) -> None:
        """Write the committed (tree-held) pages of finished requests back to host slots."""
        plans = [p for p in map(self._plan, reqs) if p.entries]
        if not plans:
            return
        groups = [plans] if self.batched_writeback else [[p] for p in plans]
        for group in groups:
            self._write(group)

    def _plan(self, req: Req) -> WritebackPlan:
        """Host pages for the pages of req's committed prefix the store lacks.

        Planned one request after another, so a page two of them share is reserved once.
        """
        committed = req.cache_protected_len  # page-aligned, held by the tree
        first, host_slots, entries = self.store.reserve(req.fill_ids[:committed])
        start = first * self.page_size
        device_slots = req.prefix_indices[start : start + len(host_slots)]
        return WritebackPlan(device_slots, host_slots, entries)

    def _write(self, plans: list[WritebackPlan]) -> None:
        """One gather and one copy for all of plans' pages."""
        device_slots = torch.cat([p.device_slots for p in plans])
        host_slots = torch.cat([p.host_slots for p in plans])
        entries = [e for p in plans for e in p.entries]
        self.store.write(self.kv, device_slots, host_slots, entries)
        self.writeback_calls += 1

    # ---- retire, check --------------------------------------------------------------------

    def retire(self, wait: bool = False) -> int:
        done = self.store.retire(wait)
        self.metrics.host_written_tokens += done
        return done

    def check(self) -> None:
        self.store.check()

    def close(self) -> None:
        self.store.close()
