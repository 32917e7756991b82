"""SwaRadixCache: a RadixCache whose nodes may drop their sliding-window KV ("tombstones").

Full-attention KV is kept as in RadixCache; the KV of window-W layers (SwaPagedAllocator's
SWA pool) is needed only for the W - 1 positions before wherever a query starts (a query
at m reads keys m - W < j <= m, and m itself is computed), so a node may lose it on its
own and stay in the tree for its full KV.

    position     0 ...... 8 ...... 16 ..... 24 ..... 32        W = 9, page 4
    node         [ tomb  ][ tomb   ][  SWA  ][  SWA  ]
    match        m = 32: [24, 32) has SWA -> valid; m = 16: [8, 16) tombstoned -> not
    lock at 32   full lock on all four nodes, SWA lock on the node(s) meeting [24, 32)

NOTE: SWA locks are counted per lock depth D (`node.swa_locks[D]`): a lock on the node
ending at D SWA-locks every path node whose range meets [D - W + 1, D). Positions never
move, so after a split the upper part keeps the depths that still reach it
(D - W + 1 < its end) and dec_lock_ref walks the same condition: locks stay exactly
reversible. With W = 1 a match needs no SWA KV at all and a lock SWA-locks nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from mpprefill.memory.allocator import cdiv
from mpprefill.memory.radix_cache import Adopted, CacheableReq, MatchResult, RadixCache, TreeNode
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.memory.swa_allocator import SwaPagedAllocator


@dataclass(slots=True, eq=False)
class SwaTreeNode(TreeNode):
    end: int = 0  # position where the key ends; its start is end - len(key)
    tombstone: bool = False  # its pages have no SWA KV
    swa_cold: bool = False  # left the window of the request that computed it: evict first
    swa_locks: dict[int, int] = field(default_factory=dict, repr=False)  # lock depth -> count

    @property
    def start(self) -> int:
        return self.end - len(self.key)


class SwaCacheableReq(CacheableReq, Protocol):
    cached_tokens: int  # the prefix matched at admission: shared, left to LRU
    swa_evicted_len: int  # disabled cache only: row[:swa_evicted_len] SWA freed


class SwaRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SwaPagedAllocator,
        page_size: int,
        sliding_window: int,
        disable: bool = False,
        free_out_of_window: bool = False,
    ) -> None:
        """`free_out_of_window`: drop the SWA KV a running request no longer sees at once
        instead of marking it cold (less SWA memory, fewer hits on shared prefixes)."""
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.free_out_of_window = free_out_of_window
        self._swa_evictable = self._swa_protected = 0
        super().__init__(req_to_token_pool, allocator, page_size, disable)

    def swa_evictable_size(self) -> int:
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def swa_total_size(self) -> int:
        return self._swa_evictable + self._swa_protected

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest cached prefix of length m whose window [m - W + 1, m) has SWA KV."""
        full = super().match_prefix(token_ids)
        node = last = full.last_node
        while node is not self.root:
            node.swa_cold = False  # matched: someone else may want it
            if node.tombstone and node.end > max(0, self._window_start(last.end)):
                last = node.parent
            node = node.parent
        return MatchResult(full.indices[: last.end], last)

    def inc_lock_ref(self, node: SwaTreeNode) -> None:
        window = list(self._window(node))
        if any(n.tombstone for n in window):
            raise RuntimeError(f"lock of {node}: its window has no SWA KV")
        super().inc_lock_ref(node)
        for n in window:
            if not n.swa_locks:
                self._swa_evictable -= len(n.key)
                self._swa_protected += len(n.key)
            n.swa_locks[node.end] = n.swa_locks.get(node.end, 0) + 1

    def dec_lock_ref(self, node: SwaTreeNode) -> None:
        window = list(self._window(node))
        if any(n.swa_locks.get(node.end, 0) <= 0 for n in window):
            raise RuntimeError(f"SWA unlock of an unlocked window at {node}")
        super().dec_lock_ref(node)
        for n in window:
            n.swa_locks[node.end] -= 1
            if n.swa_locks[node.end] == 0:
                del n.swa_locks[node.end]
                if not n.swa_locks:
                    self._swa_protected -= len(n.key)
                    self._swa_evictable += len(n.key)

    def evict(self, num_tokens: int) -> int:
        before = self.allocator.swa_available_size()
        freed = super().evict(num_tokens)
        # NOTE: evicted leaves are unlocked, and their SWA pages (tombstones have none) are
        # the only SWA pages evict frees: the pool's gain is exactly what left the tree.
        self._swa_evictable -= self.allocator.swa_available_size() - before
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        """Drop the SWA KV of LRU nodes (leaves or not) without an SWA lock; the nodes stay
        for their full KV. Returns the number of SWA tokens freed."""
        if num_tokens <= 0:
            return 0
        nodes = (n for n in self._nodes() if not n.tombstone and not n.swa_locks)
        heap = [(not n.swa_cold, n.last_access, n.id, n) for n in nodes]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            freed += self._tombstone(heapq.heappop(heap)[-1])
        return freed

    def flush(self) -> None:
        super().flush()
        self._swa_evictable = 0

    def cache_unfinished_req(self, req: SwaCacheableReq) -> None:
        """As RadixCache's; then the SWA KV its next chunk can no longer see goes first when
        the SWA pool needs room.

        The next chunk's queries start at kv_len, so keys at positions <= kv_len - W are
        never read again by this request. Pages wholly below that which it computed itself
        (from cached_tokens on) lose their SWA lock and turn "cold": `evict_swa` takes cold
        nodes before any other, so a prompt longer than the whole SWA pool runs through it.
        They are not dropped at once: a later prompt with the same start may match them
        (which warms them again), and with a shared system prompt the first request to
        compute it is the one that puts it in the tree. Without a tree nobody can match
        them, so they are freed at once.

        NOTE: after the final chunk one more page is kept warm: the same prompt sent again
        matches at most its page-aligned len - 1 tokens, and that match needs the window
        before it, which starts up to a page earlier.
        """
        super().cache_unfinished_req(req)
        kv_len, ps = len(req.fill_ids), self.page_size
        margin = ps if kv_len == len(req.origin_input_ids) else 0
        lo = cdiv(req.cached_tokens, ps) * ps
        hi = self._aligned(max(0, kv_len - self.sliding_window + 1 - margin))
        if self.disable:
            lo = max(lo, req.swa_evicted_len)
            if lo < hi:
                row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
                self.allocator.free_swa(row[lo:hi])
                req.swa_evicted_len = hi
        elif lo < hi:
            self._leave_window(req.last_node, lo, hi)

    def insert_loaded(
        self, token_ids: Sequence[int], slots: Tensor, fresh_from: int, swa_from: int
    ) -> Adopted:
        """As RadixCache's, with SWA KV only at [swa_from, len(token_ids)) (a checkpoint):
        fresh pages below swa_from become tombstones, those past it revive tombstones the
        tree holds for the same tokens (as a computed request's copies do).

            position   0 ... fresh_from ........ swa_from ......... n
            slots      [ tree ][ fresh           ][ fresh           ]
            after      [ tree ][ full KV only    ][ full and SWA KV ]
        """
        ps, n = self.page_size, len(token_ids)
        if swa_from % ps or not fresh_from <= swa_from <= n:
            raise ValueError(f"insert_loaded: bad SWA start {swa_from} for [{fresh_from}, {n})")
        fresh = slots[fresh_from::ps] // ps
        fresh_swa = self.allocator.swa_page_of[fresh].clone()
        if fresh_from < swa_from < n:
            RadixCache.match_prefix(self, token_ids[:swa_from])  # no node straddles swa_from
        row = slots.clone()
        self._revive_row(row, token_ids, swa_from)
        present = RadixCache.insert(self, token_ids, row)
        self.allocator.free(row[fresh_from:present])
        if present < swa_from:
            last = RadixCache.match_prefix(self, token_ids).last_node
            self._leave_window(last, present, swa_from, tombstone=True)
        pages = self.path_slots(token_ids)[::ps] // ps
        mine = self._fresh_pages(pages, fresh_from // ps, fresh)
        swa_pages = self.allocator.swa_page_of[pages]
        theirs = self._fresh_pages(swa_pages, swa_from // ps, fresh_swa[fresh_swa >= 0])
        swa_slots = self.allocator.swa.slots_of(swa_pages[theirs])
        return Adopted(mine, self.allocator.slots_of(pages[mine]), theirs, swa_slots)

    def _leave_window(self, node: SwaTreeNode, lo: int, hi: int, tombstone: bool = False) -> None:
        """Mark positions [lo, hi) on node's path cold (or tombstone them, with
        free_out_of_window or `tombstone`), splitting nodes at lo and hi, except those an
        SWA lock still needs."""
        tombstone = tombstone or self.free_out_of_window
        while node is not self.root and node.end > lo:
            start, end = node.start, min(node.end, hi)
            if max(start, lo) < end and not node.tombstone and not self._locked_below(node, end):
                if end < node.end:
                    node = self._split(node, end - start)
                if start < lo:
                    self._split(node, lo - start)
                if tombstone:
                    self._tombstone(node)
                else:
                    node.swa_cold = True
            node = node.parent

    def _insert_req(self, req: CacheableReq, token_ids: Sequence[int]) -> int:
        """As RadixCache's, after giving tombstones the request's fresh copies of their
        pages, before those are freed as duplicates: else a prefix once tombstoned would be
        recomputed forever."""
        aligned = self._aligned(len(token_ids))
        if aligned > req.cache_protected_len:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self._revive_row(row, token_ids[:aligned], req.cache_protected_len)
        return super()._insert_req(req, token_ids)

    def _revive_row(self, row: Tensor, token_ids: Sequence[int], lo: int) -> None:
        """Revive the tombstones on token_ids' path from position lo on whose pages in `row`
        (slots of token_ids, the caller's past lo) all have SWA KV.

        Unlocked: the node and the row swap slots, so the node's old pages are the ones
        freed, and the row is rewritten with the node's new ones. Locked: the rows of its
        holders keep its slots, so the row's SWA pages move under the node's pages.
        """
        node = RadixCache.match_prefix(self, token_ids).last_node
        while node is not self.root and node.start >= lo:
            mine = row[node.start : node.end]
            if node.tombstone and bool(self.allocator.has_swa(mine).all()):
                if node.lock_ref == 0:
                    row[node.start : node.end], node.value = node.value, mine.clone()
                else:
                    self.allocator.move_swa(mine, node.value)
                node.tombstone = node.swa_cold = False
                self._swa_evictable += len(node.key)
            node = node.parent

    def _node(self, parent: SwaTreeNode | None, key: list[int], value: Tensor) -> SwaTreeNode:
        self._next_id += 1
        end = (0 if parent is None else parent.end) + len(key)
        return SwaTreeNode(self._next_id, parent, key, value, end=end)

    def _split(self, child: SwaTreeNode, n: int) -> SwaTreeNode:
        upper = super()._split(child, n)
        upper.tombstone, upper.swa_cold = child.tombstone, child.swa_cold
        reach = upper.end + self.sliding_window - 1
        upper.swa_locks = {d: c for d, c in child.swa_locks.items() if d < reach}
        if child.swa_locks and not upper.swa_locks and not child.tombstone:
            self._swa_protected -= n
            self._swa_evictable += n
        return upper

    def _add_leaf(self, parent: SwaTreeNode, key: list[int], value: Tensor, now: int) -> None:
        super()._add_leaf(parent, key, value, now)
        self._swa_evictable += len(key)

    def _window(self, node: SwaTreeNode) -> Iterator[SwaTreeNode]:
        """The path nodes that a lock on node SWA-locks: those meeting [end - W + 1, end)."""
        start, n = self._window_start(node.end), node
        while n is not self.root and n.end > start:
            yield n
            n = n.parent

    def _locked_below(self, node: SwaTreeNode, end: int) -> bool:
        """Would node's part [start, end) keep an SWA lock?"""
        return any(self._window_start(d) < end for d in node.swa_locks)

    def _window_start(self, depth: int) -> int:
        """First key position a query at `depth` reads from the cache: depth - W + 1."""
        return depth - self.sliding_window + 1

    def _tombstone(self, node: SwaTreeNode) -> int:
        self.allocator.free_swa(node.value)
        node.tombstone = True
        self._swa_evictable -= len(node.key)
        return len(node.key)

    def check(self) -> None:
        super().check()
        sizes = [0, 0]  # SWA unlocked, SWA locked
        expected: dict[int, dict[int, int]] = {}
        for node in self._nodes():
            assert node.end == node.parent.end + len(node.key), node
            has = self.allocator.has_swa(node.value)
            assert bool((~has).all() if node.tombstone else has.all()), f"{node}: mixed SWA"
            assert not (node.tombstone and node.swa_locks), f"{node}: locked without SWA"
            assert all(c > 0 for c in node.swa_locks.values()), node
            sizes[bool(node.swa_locks)] += 0 if node.tombstone else len(node.key)
            direct = node.lock_ref - sum(c.lock_ref for c in node.children.values())
            for n in self._window(node) if direct else ():
                locks = expected.setdefault(n.id, {})
                locks[node.end] = locks.get(node.end, 0) + direct
        assert sizes == [self._swa_evictable, self._swa_protected], (sizes, self)
        for node in self._nodes():
            assert node.swa_locks == expected.get(node.id, {}), (node, node.swa_locks)

    def __repr__(self) -> str:
        return (
            f"SwaRadixCache(page_size={self.page_size}, window={self.sliding_window}, "
            f"evictable={self._evictable}, protected={self._protected}, "
            f"swa_evictable={self._swa_evictable}, swa_protected={self._swa_protected}, "
            f"disable={self.disable})"
        )
