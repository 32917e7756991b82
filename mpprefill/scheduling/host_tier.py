"""HostTier: the host KV store wired to the scheduler's radix cache, allocator and KV pool.

The entry points run on the scheduler thread and only plan and retire; every copy runs on
the store's copy thread (`HostCopier`), in the order planned:
- `match_prefix` (admission): a device match, extended by loading the ready host pages that
  follow it into fresh device pages, which join the tree before the request locks them.
  The load is queued; `wait_loads` (before the next early send and submit) orders it
  before anything reads those pages.
- `write_back` (result processing): the committed pages of requests whose final chunk just
  finished are written back to host slots: one gather and one copy for the whole set (or
  one per request with batched write-back off). The tier locks the tree nodes whose pages
  the copy reads until it retires, so none is evicted and reused under it.
- `retire` (top of every loop iteration): finished copies become matchable, their locks go.
- `flush` (a cache flush, nothing live): every copy ends, then the whole store is dropped.
- `note_submit` (each submit): which SWA pages a forward writes, the SWA pool's KV fence.

With sliding-window (SWA) layers a prefix of length m is usable only with the SWA KV of
its window [m - W + 1, m). Write-back therefore also stores checkpoints: the SWA KV of the
window before the request's committed end, before its cached prefix's end and before
the point where it left the chains the store already held (where later prompts of the
same family stop). A host hit at m loads the full KV of its pages and the SWA KV of the
window pages past the device match; the device match's own lock keeps the window part
below it.

    position   0 ........ D .................. m - W + 1 ........ m
    device     [ matched ][ loaded: full KV only ][ loaded: full and SWA KV ]
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from mpprefill.emulation.setup import host_link_for
from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.host.index import HostPage
from mpprefill.memory.host.store import HostKVStore, PoolWrite, Reservation
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.radix_cache import MatchResult, RadixCache, TreeNode
from mpprefill.scheduling.kv_pools import reclaim
from mpprefill.scheduling.metrics import SchedulerMetrics
from mpprefill.scheduling.req import Req

if TYPE_CHECKING:
    from mpprefill.layer_configs import HostTierConfig
    from mpprefill.worker.api import ForwardInput, Worker
    from mpprefill.worker.fence import KVWriteFence


def make_host_tier(
    cfg: HostTierConfig,
    tree: RadixCache,
    allocator: PagedTokenAllocator,
    worker: Worker,
    metrics: SchedulerMetrics,
) -> HostTier | None:
    """The host tier --host-store-size asks for, over the worker's KV pool; None when 0."""
    if cfg.size <= 0:
        return None
    kv = worker.kv_cache
    store = HostKVStore(cfg.size, cfg.page_size, kv, host_link_for(cfg.device))
    return HostTier(store, tree, allocator, kv, cfg.batched_writeback, metrics, worker.kv_fence)


class WritebackPlan(NamedTuple):
    full: PoolWrite
    entries: list[HostPage]
    swa: PoolWrite | None
    swa_entries: list[HostPage]
    nodes: list[TreeNode]  # locked until the copy retires: their pages are read


class _Held(NamedTuple):
    future: Future
    nodes: list[TreeNode]
    num_reqs: int


MAX_STAGING_LOG = 4096
logger = logging.getLogger(__name__)


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
        self.window: int | None = None  # the SWA layers' window; None: no SWA layers
        self._swa_writer: Tensor | None = None  # last forward writing each SWA page
        if allocator.has_swa_pool:
            if not store.has_swa:
                raise ValueError("the host store has no SWA pool for a sliding-window model")
            self.window = tree.sliding_window
            num_swa_pages = allocator.swa_size // self.page_size
            self._swa_writer = torch.zeros(num_swa_pages, dtype=torch.int64)
        self.batched_writeback = batched_writeback
        self.metrics = metrics or SchedulerMetrics()
        self._held: deque[_Held] = deque()  # write-backs in flight, oldest first
        self._loads: list[Future] = []  # loads not yet waited for
        # (finishing requests, copy-thread seconds) of each retired write-back
        self.staging_log: deque[tuple[int, float]] = deque(maxlen=MAX_STAGING_LOG)

    def note_submit(self, inp: ForwardInput) -> None:
        """Forward inp.seq writes these SWA pages: a load into one waits for it."""
        locs = inp.forward.swa_out_cache_loc
        if self._swa_writer is not None and len(locs):
            self._swa_writer.index_fill_(0, locs.to("cpu", torch.int64) // self.page_size, inp.seq)

    # ---- load on a prefix hit -------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], limit: int, budget: Callable[[], int], partial: bool
    ) -> tuple[MatchResult, int]:
        """The device match, extended by loading the ready host pages that follow it within
        token_ids[:limit]; loaded pages join the tree, unlocked. Also returns how many such
        host pages were left on the host: when fewer than all fit in budget() device pages,
        partial loads what fits, else nothing is loaded."""
        ids = token_ids[:limit] if self.window is not None else token_ids
        dev = self.tree.match_prefix(ids)
        have = len(dev.indices) // self.page_size
        chain = self.store.match(token_ids[:limit])
        ends = self._loadable_ends(chain, have)
        if not ends:
            return dev, 0
        self.tree.inc_lock_ref(dev.last_node)  # NOTE: the eviction below must not take it
        try:
            room = max(budget(), 0)
            fit = [n for n in ends if n - have <= room]
            if not fit or (fit[-1] < ends[-1] and not partial):
                return dev, ends[-1] - have
            self._load(ids, dev.indices, chain, fit[-1])
        finally:
            self.tree.dec_lock_ref(dev.last_node)
        return self.tree.match_prefix(ids), ends[-1] - fit[-1]

    def _loadable_ends(self, chain: list[HostPage], have: int) -> list[int]:
        """Page counts n > have a host hit may end at: with SWA layers, the window pages
        of n past the device match must have their SWA KV on the host."""
        if self.window is None:
            return list(range(have + 1, len(chain) + 1))
        ok = [e.swa_page >= 0 and e.swa_ready for e in chain]
        ends = []
        for n in range(have + 1, len(chain) + 1):
            if all(ok[max(have, self._window_page(n * self.page_size)) : n]):
                ends.append(n)
        return ends

    def _window_page(self, end: int) -> int:
        """The prompt page holding the first key of the window before position end."""
        return max(0, end - self.window + 1) // self.page_size

    def _load(
        self, token_ids: Sequence[int], prefix: Tensor, chain: list[HostPage], n: int
    ) -> None:
        ps = self.page_size
        slots = self._alloc(n - len(prefix) // ps)
        swa_from = n * ps
        if self.window is not None:
            swa_from = max(len(prefix), self._window_page(n * ps) * ps)
        row = torch.cat([prefix, slots])
        got = self.tree.insert_loaded(token_ids[: n * ps], row, len(prefix), swa_from)
        before = self._writes_before(got.full_slots, got.swa_slots)
        full = [chain[p] for p in got.full_pages.tolist()]
        swa = [chain[p] for p in got.swa_pages.tolist()]
        self._loads.append(
            self.store.load(full, self.kv, got.full_slots, swa, got.swa_slots, before)
        )
        self.metrics.host_loaded_tokens += len(full) * ps

    def _writes_before(self, full_slots: Tensor, swa_slots: Tensor) -> Callable[[], None] | None:
        """What a load must wait for (on the copy thread) before it writes these slots.

        NOTE: freed pages can be handed out while the forward in flight still writes
        them (a request's duplicate copies, SWA pages out of its window); load only once
        that forward is done."""
        if self.fence is None:
            return None
        gen = self.fence.required(torch.unique(full_slots // self.page_size))
        if self._swa_writer is not None and len(swa_slots):
            gen = max(gen, int(self._swa_writer[swa_slots // self.page_size].max()))
        if self.fence.done(gen):
            return None
        fence = self.fence
        return lambda: fence.wait(gen)

    def wait_loads(self) -> None:
        """Block until every load queued so far has filled its device pages: before an
        early send or a submit, which read them."""
        loads, self._loads = self._loads, []
        for future in loads:
            future.result()  # a failed load is a bug: raise it on the scheduler thread

    def _alloc(self, num_pages: int) -> Tensor:
        reclaim(self.tree, self.allocator, num_pages)
        slots = self.allocator.alloc(num_pages * self.page_size)
        if slots is None:
            raise RuntimeError(f"no {num_pages} device pages for a host load within budget")
        return slots

    # ---- write-back of finished requests --------------------------------------------------

    def write_back(self, reqs: list[Req]) -> None:
        """Write the committed (tree-held) pages of finished requests back to host slots,
        with their SWA checkpoints."""
        plans = [p for p in map(self._plan, reqs) if p.entries or p.swa_entries]
        if not plans:
            return
        groups = [plans] if self.batched_writeback else [[p] for p in plans]
        for group in groups:
            self._write(group)

    def _plan(self, req: Req) -> WritebackPlan:
        """Host pages for the pages of req's committed prefix the store lacks, and host SWA
        pages for its checkpoints' pages that lack them.

        Planned one request after another, so a page two of them share is reserved once.
        """
        committed = req.cache_protected_len  # page-aligned, held by the tree
        res = self.store.reserve(req.fill_ids[:committed])
        start = res.first_page * self.page_size
        device_slots = req.prefix_indices[start : start + len(res.host_slots)]
        full = PoolWrite(device_slots, res.host_slots)
        if self.window is None:
            return WritebackPlan(full, res.entries, None, [], [req.last_node])
        ends = self._checkpoints(req, res)
        pages = sorted(
            {p for end in ends for p in range(self._window_page(end), end // self.page_size)}
        )
        pages = [p for p in pages if res.chain[p].swa_page < 0]
        host_slots, swa_entries = self.store.reserve_swa([res.chain[p] for p in pages])
        device = self._page_slots(req.prefix_indices, pages)
        swa = PoolWrite(self.allocator.translate(device), host_slots)
        # NOTE: req.last_node ends at the committed end: its lock holds that window too
        nodes = [req.last_node] + [self._node_at(req, end) for end in ends if end != committed]
        return WritebackPlan(full, res.entries, swa, swa_entries, nodes)

    def _checkpoints(self, req: Req, res: Reservation) -> list[int]:
        """Prefix ends whose windows are checkpointed: req's committed end, its cached
        prefix's end and the first page the store lacked, where the device still has the
        window's SWA KV and the store its pages."""
        ps, held = self.page_size, len(res.chain)
        ends = {req.cache_protected_len, req.cached_tokens, res.first_page * ps}
        kept = []
        for end in sorted(ends):
            if end <= 0 or end % ps or end > held * ps:
                continue
            window = list(range(self._window_page(end), end // ps))
            if bool(self.allocator.has_swa(self._page_slots(req.prefix_indices, window)).all()):
                kept.append(end)
        return kept

    def _node_at(self, req: Req, end: int) -> TreeNode:
        node = self.tree.node_at(req.fill_ids[:end])
        if node.end != end:
            raise RuntimeError(f"no tree node ends at {end} of a committed prefix")
        return node

    def _page_slots(self, prefix: Tensor, pages: list[int]) -> Tensor:
        """Slots of the given prompt pages of a prefix, whole pages in order."""
        ps = self.page_size
        starts = prefix[torch.tensor(pages, dtype=torch.int64) * ps]
        return self.allocator.slots_of(starts // ps)

    def _write(self, plans: list[WritebackPlan]) -> None:
        """One gather and one copy per pool for all of plans' pages, their nodes locked."""
        full = PoolWrite(*(torch.cat(parts) for parts in zip(*(p.full for p in plans))))
        entries = [e for p in plans for e in p.entries]
        swa, swa_entries = None, [e for p in plans for e in p.swa_entries]
        if swa_entries:
            swa = PoolWrite(*(torch.cat(x) for x in zip(*(p.swa for p in plans if p.swa))))
        nodes = [n for p in plans for n in p.nodes]
        for node in nodes:
            self.tree.inc_lock_ref(node)
        future = self.store.write(self.kv, full, entries, swa, swa_entries)
        self._held.append(_Held(future, nodes, len(plans)))

    # ---- retire, check --------------------------------------------------------------------

    def retire(self, wait: bool = False) -> int:
        """Finished write-backs become matchable and unlock their nodes; with wait, all
        of them (and the loads). Tokens written back."""
        if wait:
            self.wait_loads()
        in_flight = self.store.writes_in_flight
        done = self.store.retire(wait)
        for _ in range(in_flight - self.store.writes_in_flight):  # the same writes, in order
            held = self._held.popleft()
            self.staging_log.append((held.num_reqs, held.future.result()))
            for node in held.nodes:
                self.tree.dec_lock_ref(node)
        self.metrics.host_written_tokens += done
        return done

    def flush(self) -> int:
        """Drop the whole host store once every copy in flight has ended (write-backs
        retired, their nodes unlocked); tokens dropped."""
        self.retire(wait=True)
        return self.store.flush()

    def check(self) -> None:
        self.store.check()
        assert len(self._held) == self.store.writes_in_flight, "host tier: write locks drifted"

    def close(self) -> None:
        """Wait for every copy, whatever its outcome, and stop the copy thread."""
        try:
            self.retire(wait=True)
        except Exception:  # a dead worker's fence, a failed copy: the server is going
            logger.exception("a host-tier copy failed; closing the host tier anyway")
        finally:
            self.store.close()
