"""RadixCache: a radix tree of token ids to KV slots, in whole pages, shared across requests."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.req_to_token import ReqToTokenPool

# NOTE: ranges of a request's req_to_token row when it is cached; e.g. page_size 4, 10 tokens
# of KV of which 4 were matched: protected = 4, aligned = 8, 4 <= present <= 8.
#
#   [0, protected)        tree slots, kept alive by the lock on req.last_node
#   [protected, present)  the request's copies of pages the tree already had: freed, and
#                         the row is rewritten with the tree's slots
#   [present, aligned)    the request's slots, adopted by the tree on insert
#   [aligned, kv_len)     the partial last page, the request's own: the tree holds whole pages


def _empty() -> Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(slots=True, eq=False)
class TreeNode:
    id: int
    parent: TreeNode | None = field(repr=False)
    key: list[int] = field(repr=False)
    value: Tensor = field(repr=False)
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0


class MatchResult(NamedTuple):
    indices: Tensor
    last_node: TreeNode


class Adopted(NamedTuple):
    """Pages of a prefix whose KV a loader must write, after `insert_loaded`: prompt page
    numbers and the device slots now behind them (whole pages), per pool."""

    full_pages: Tensor
    full_slots: Tensor
    swa_pages: Tensor
    swa_slots: Tensor  # slots of the SWA pool


class CacheableReq(Protocol):
    """A request as the cache sees it: req_to_token[req_pool_idx, :len(fill_ids)] holds its
    KV slots, of which the first cache_protected_len are the tree's, locked via last_node."""

    req_pool_idx: int
    origin_input_ids: list[int]
    fill_ids: list[int]
    prefix_indices: Tensor
    last_node: TreeNode
    cache_protected_len: int


class RadixCache:
    """NOTE: eviction pops a lazy heap of (last_access, id, node): a node is pushed
    whenever it may have become an evictable leaf or was touched as one (added, matched or
    inserted through as the deepest node, unlocked, or its last child gone); a record
    whose node has left the tree, is no evictable leaf, or was touched since is skipped."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: PagedTokenAllocator,
        page_size: int,
        disable: bool = False,
    ) -> None:
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator's {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._clock = 0
        self._next_id = 0
        self.root = self._node(None, [], _empty())
        self._evictable = self._protected = 0
        self._num_nodes = 0  # in the tree, root aside
        self._leaves: list[tuple[int, int, TreeNode]] = []  # the lazy eviction heap

    def _node(self, parent: TreeNode | None, key: list[int], value: Tensor) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, parent, key, value)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- sliding-window KV: none held apart here (SwaRadixCache holds it) -----------------

    def swa_evictable_size(self) -> int:
        return 0

    def swa_total_size(self) -> int:
        return 0

    def evict_swa(self, num_tokens: int) -> int:
        return 0

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Slots of the longest cached prefix, in whole pages, and the node it ends at."""
        if self.disable:
            return MatchResult(_empty(), self.root)
        key = list(token_ids[: self._aligned(len(token_ids))])
        node, values, now = self.root, [], self._tick()
        while key and (child := node.children.get(self._page_key(key))) is not None:
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, key = child, key[n:]
        self._push_leaf(node)
        return MatchResult(torch.cat(values) if values else _empty(), node)

    def insert(self, token_ids: Sequence[int], slots: Tensor) -> int:
        """Cache the whole pages of token_ids; returns how many tokens were already cached.

        Slots past that length now belong to the tree; those before it stay the caller's.
        Disabled, nothing is stored and the whole key counts as present: the caller keeps all.
        """
        n = self._aligned(len(token_ids))
        if self.disable:
            return n
        if len(slots) < n:
            raise ValueError(f"insert: {len(slots)} slots for {n} tokens")
        key, value = list(token_ids[:n]), slots[:n]
        node, present, now = self.root, 0, self._tick()
        while key:
            child = node.children.get(self._page_key(key))
            if child is None:
                self._add_leaf(node, key, value, now)
                break
            m = self._match_len(child.key, key)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            node, key, value, present = child, key[m:], value[m:], present + m
        self._push_leaf(node)
        return present

    def path_slots(self, token_ids: Sequence[int]) -> Tensor:
        """Slots of the longest prefix of token_ids the tree holds, whole pages, whatever
        the sliding-window layers hold (RadixCache's own match)."""
        return RadixCache.match_prefix(self, token_ids).indices

    def node_at(self, token_ids: Sequence[int]) -> TreeNode:
        """The node where the tree's path of token_ids ends (split there), whatever the
        sliding-window layers hold; no access is recorded beyond RadixCache's match."""
        return RadixCache.match_prefix(self, token_ids).last_node

    def insert_loaded(
        self, token_ids: Sequence[int], slots: Tensor, fresh_from: int, swa_from: int
    ) -> Adopted:
        """Cache pages whose KV is being loaded: slots[fresh_from:] are fresh device pages
        (the caller's), the rest the tree's own. Fresh duplicates of pages the tree holds
        are freed; what the tree adopts is returned for the loader to fill. (`swa_from`:
        where SWA KV starts, for SwaRadixCache; nothing here.)"""
        fresh = slots[fresh_from :: self.page_size] // self.page_size
        present = self.insert(token_ids, slots)
        self.allocator.free(slots[fresh_from:present])
        pages = self.path_slots(token_ids)[:: self.page_size] // self.page_size
        mine = self._fresh_pages(pages, fresh_from // self.page_size, fresh)
        return Adopted(mine, self.allocator.slots_of(pages[mine]), _empty(), _empty())

    @staticmethod
    def _fresh_pages(pages: Tensor, first: int, fresh: Tensor) -> Tensor:
        """Prompt page numbers, from `first` on, whose page (`pages`: per prompt page) is
        one of `fresh`."""
        return torch.isin(pages[first:], fresh).nonzero().flatten() + first

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        deepest = node
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent
        self._push_leaf(deepest)  # NOTE: the nodes above it have a child: no leaves

    def evict(self, num_tokens: int) -> int:
        """Free LRU unlocked leaves until num_tokens are freed; returns the number freed."""
        if num_tokens <= 0:
            return 0
        freed = 0
        values = []
        while freed < num_tokens and self._leaves:
            access, _, node = heapq.heappop(self._leaves)
            if access != node.last_access or not self._evictable_leaf(node):
                continue
            if not self._in_tree(node):
                continue
            values.append(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            self._num_nodes -= 1
            del node.parent.children[self._page_key(node.key)]
            self._push_leaf(node.parent)
        if values:  # one free for all: each call costs far more than its slots
            self.allocator.free(torch.cat(values))
        return freed

    def flush(self) -> None:
        """Drop the whole tree, freeing its slots; refused while any node is locked."""
        if self._protected:
            raise RuntimeError(f"flush with {self._protected} locked tokens in the cache")
        values = [node.value for node in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        # NOTE: the root object stays: requests that matched nothing hold it as last_node.
        self.root.children.clear()
        self._evictable = 0
        self._num_nodes = 0
        self._leaves.clear()

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Cache a request's KV so far and keep it locked: its next chunk extends it."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv_len = len(req.fill_ids)
        if self.disable:
            req.prefix_indices = row[:kv_len].clone()
            return
        aligned = self._insert_req(req, req.fill_ids)
        new = self.match_prefix(req.fill_ids[:aligned])
        if len(new.indices) != aligned:
            raise RuntimeError(f"re-match found {len(new.indices)} of {aligned} tokens")
        row[req.cache_protected_len : aligned] = new.indices[req.cache_protected_len :]
        self.inc_lock_ref(new.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new.indices, row[aligned:kv_len]])
        req.cache_protected_len = aligned
        req.last_node = new.last_node

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Cache a request's KV, free the rest and unlock; the caller frees the row after."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        kv_len = len(req.fill_ids)
        if self.disable:
            self.allocator.free(row[req.cache_protected_len : kv_len])
            return
        aligned = self._insert_req(req, req.origin_input_ids[:kv_len])
        self.allocator.free(row[aligned:kv_len])
        self.dec_lock_ref(req.last_node)

    def _insert_req(self, req: CacheableReq, token_ids: Sequence[int]) -> int:
        """Insert the request's whole pages, free its duplicates; returns the length cached."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        aligned = self._aligned(len(token_ids))
        if aligned < req.cache_protected_len:
            raise RuntimeError(f"KV of {len(token_ids)} tokens is shorter than its prefix")
        present = self.insert(token_ids[:aligned], row[:aligned])
        if present < req.cache_protected_len:
            raise RuntimeError("a locked prefix is missing from the tree")
        self.allocator.free(row[req.cache_protected_len : present])
        return aligned

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _page_key(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            return n
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        return self._aligned(i)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; the new upper node is returned. The child object keeps
        the lower part, so locks held on it still walk through the new node."""
        upper = self._node(child.parent, child.key[:n], child.value[:n].clone())
        self._num_nodes += 1
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.parent.children[self._page_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:].clone(), upper
        upper.children[self._page_key(child.key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: Tensor, now: int) -> None:
        leaf = self._node(parent, key, value.clone())
        leaf.last_access = now
        parent.children[self._page_key(key)] = leaf
        self._evictable += len(key)
        self._num_nodes += 1
        self._push_leaf(leaf)

    def _evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _in_tree(self, node: TreeNode) -> bool:
        """Not evicted since its heap record was pushed (only a popped record can lag)."""
        return node.parent.children.get(self._page_key(node.key)) is node

    def _push_leaf(self, node: TreeNode) -> None:
        if not self._evictable_leaf(node):
            return
        heapq.heappush(self._leaves, (node.last_access, node.id, node))
        if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale records: rebuild
            live = (n for n in self._nodes() if self._evictable_leaf(n))
            self._leaves = [(n.last_access, n.id, n) for n in live]
            heapq.heapify(self._leaves)

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def check(self) -> None:
        sizes = [0, 0]  # unlocked, locked
        values = [_empty()]
        queued = {(access, node.id) for access, _, node in self._leaves}
        num_nodes = 0
        for node in self._nodes():
            num_nodes += 1
            if self._evictable_leaf(node):
                assert (node.last_access, node.id) in queued, f"{node} cannot be evicted"
            n = len(node.key)
            assert n > 0 and n % self.page_size == 0 and len(node.value) == n, node
            assert node.parent.children.get(self._page_key(node.key)) is node, node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
            sizes[node.lock_ref > 0] += n
            values.append(node.value)
        assert self.root.lock_ref == 0 and not self.root.key
        assert num_nodes == self._num_nodes, f"node count drifted: {self._num_nodes}"
        assert sizes == [self._evictable, self._protected], (sizes, self)
        slots = torch.cat(values)
        pages = slots.view(-1, self.page_size)
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        assert bool((pages == pages[:, :1] + offsets).all()), "tree slots are not whole pages"
        assert bool((pages[:, 0] % self.page_size == 0).all()), "tree page is misaligned"
        assert len(torch.unique(slots)) == len(slots), "a slot is in two tree nodes"
        assert self.allocator.is_held(slots), "tree holds a free slot"

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, "
            f"protected={self._protected}, disable={self.disable})"
        )
