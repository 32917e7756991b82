from __future__ import annotations

import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.radix_cache import RadixCache
from mpprefill.memory.req_to_token import ReqToTokenPool


def make_cache(page_size: int = 4, num_pages: int = 32, disable: bool = False) -> RadixCache:
    alloc = PagedTokenAllocator(num_pages, page_size)
    return RadixCache(ReqToTokenPool(4, 128), alloc, page_size, disable=disable)


def put(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Insert tokens with fresh slots the way a request would: duplicates go back."""
    slots = cache.allocator.alloc_extend([0], [len(tokens)], [-1])
    present = cache.insert(tokens, slots)
    cache.allocator.free(slots[:present])
    aligned = len(tokens) - len(tokens) % cache.page_size
    cache.allocator.free(slots[aligned:])
    return slots


def test_empty_tree_matches_nothing():
    cache = make_cache()
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert len(m.indices) == 0 and m.last_node is cache.root
    cache.check()


def test_insert_then_match_whole_pages_only():
    cache = make_cache(page_size=4)
    tokens = list(range(10))
    slots = put(cache, tokens)
    assert cache.total_size() == 8 and cache.evictable_size() == 8  # tail page not cached
    assert cache.match_prefix(tokens).indices.tolist() == slots[:8].tolist()
    assert cache.match_prefix(tokens + [99]).indices.tolist() == slots[:8].tolist()
    assert len(cache.match_prefix(tokens[:3]).indices) == 0
    assert cache.allocator.num_free_pages == 32 - 2
    cache.check()


def test_match_splits_at_page_boundary():
    cache = make_cache(page_size=4)
    tokens = list(range(12))
    slots = put(cache, tokens)
    m = cache.match_prefix(tokens[:7])
    assert m.indices.tolist() == slots[:4].tolist()
    assert len(m.last_node.key) == 4 and len(cache.root.children) == 1
    (child,) = m.last_node.children.values()
    assert child.key == tokens[4:12]
    assert cache.match_prefix(tokens).indices.tolist() == slots[:12].tolist()
    cache.check()


def test_insert_returns_already_cached_length():
    cache = make_cache(page_size=4)
    a = list(range(12))
    put(cache, a)
    slots = cache.allocator.alloc(12)
    assert cache.insert(a[:8] + [50, 51, 52, 53], slots) == 8
    cache.allocator.free(slots[:8])
    assert cache.total_size() == 16
    # a divergence inside a page counts only whole pages as present
    b = a[:6] + [60, 61]
    slots = cache.allocator.alloc(8)
    assert cache.insert(b, slots) == 4
    cache.allocator.free(slots[:4])
    assert len(cache.match_prefix(b).indices) == 8
    cache.check()


def test_page_size_one_splits_anywhere():
    cache = make_cache(page_size=1)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 9])
    assert len(cache.match_prefix([1, 2, 3, 7]).indices) == 3
    assert cache.total_size() == 5
    cache.check()


def test_lock_protects_from_eviction():
    cache = make_cache(page_size=4)
    put(cache, list(range(8)))
    node = cache.match_prefix(list(range(8))).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert cache.evict(100) == 0
    put(cache, list(range(8)) + [9, 9, 9, 9])  # unlocked child of a locked node
    assert cache.evict(100) == 4 and cache.total_size() == 8
    with pytest.raises(RuntimeError):
        cache.flush()
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evict(100) == 8 and cache.allocator.num_free_pages == 32
    cache.check()


def test_split_keeps_lock_counts():
    cache = make_cache(page_size=4)
    a = list(range(12))
    put(cache, a)
    node = cache.match_prefix(a).last_node
    cache.inc_lock_ref(node)
    put(cache, a[:4] + [70, 71, 72, 73])  # splits the locked node after one page
    assert cache.protected_size() == 12 and cache.evictable_size() == 4
    cache.check()
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 16
    cache.check()


def test_evicts_least_recently_used_leaf_first():
    cache = make_cache(page_size=4)
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    for tokens in (x, y, z):
        put(cache, tokens)
    cache.match_prefix(x)
    assert cache.evict(1) == 4
    assert len(cache.match_prefix(y).indices) == 0
    assert cache.evict(4) == 4
    assert len(cache.match_prefix(z).indices) == 0 and len(cache.match_prefix(x).indices) == 4
    cache.check()


def test_parent_becomes_leaf_and_is_evicted():
    cache = make_cache(page_size=4)
    put(cache, list(range(8)))
    put(cache, list(range(12)))
    assert cache.evict(8) == 12 and cache.total_size() == 0
    assert cache.allocator.num_free_pages == 32
    cache.check()


def test_flush_frees_everything():
    cache = make_cache(page_size=4)
    put(cache, list(range(16)))
    put(cache, [5] * 9)
    cache.flush()
    assert cache.total_size() == 0 and cache.allocator.num_free_pages == 32
    assert len(cache.match_prefix(list(range(16))).indices) == 0
    cache.check()


def test_check_catches_a_freed_tree_slot():
    cache = make_cache(page_size=4)
    slots = put(cache, list(range(8)))
    cache.allocator.free(slots[:1])
    with pytest.raises(AssertionError):
        cache.check()


def test_disabled_cache_stores_nothing():
    cache = make_cache(page_size=4, disable=True)
    slots = cache.allocator.alloc(8)
    assert cache.insert(list(range(10)), slots) == 8  # the caller keeps its slots
    m = cache.match_prefix(list(range(8)))
    assert len(m.indices) == 0 and m.last_node is cache.root
    cache.inc_lock_ref(m.last_node)
    assert cache.total_size() == 0 and cache.evict(10) == 0
    cache.check()


def test_repr_shows_the_holdings():
    cache = make_cache(page_size=4)
    put(cache, list(range(12)))
    assert "evictable=12" in repr(cache)


def test_no_sliding_window_kv_is_held_apart():
    cache = make_cache(page_size=4)
    put(cache, list(range(12)))
    assert cache.swa_evictable_size() == cache.swa_total_size() == 0
    assert cache.evict_swa(8) == 0 and cache.total_size() == 12


def _scan_lru_leaves(cache: RadixCache, num_tokens: int) -> list[int]:
    """Node ids a full scan of the tree would evict for num_tokens, in order."""

    def leaf(n) -> bool:
        return n is not cache.root and not n.children and n.lock_ref == 0

    heap = [(n.last_access, n.id, n) for n in cache._nodes() if leaf(n)]
    heapq.heapify(heap)
    gone, freed, order = set(), 0, []
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        order.append(node.id)
        gone.add(node.id)
        freed += len(node.key)
        parent = node.parent
        rest = [c for c in parent.children.values() if c.id not in gone]
        if parent is not cache.root and not rest and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return order


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("imlue"), st.integers(0, 7), st.integers(1, 5)),
                max_size=60))  # fmt: skip
def test_eviction_takes_the_leaves_a_full_scan_would(ops):
    """The lazy heap evicts what scanning every leaf for the least recently used would,
    through inserts, matches, locks, unlocks and evictions in any order."""
    cache = make_cache(page_size=2, num_pages=64)
    locks = []
    for op, family, pages in ops:
        tokens = [family] * 2 + list(range(2 * pages))  # families share nothing; depth varies
        if op == "i" and cache.allocator.num_free_pages >= pages + 1:
            put(cache, tokens)
        elif op == "m":
            cache.match_prefix(tokens)
        elif op == "l":
            node = cache.match_prefix(tokens).last_node
            cache.inc_lock_ref(node)
            locks.append(node)
        elif op == "u" and locks:
            cache.dec_lock_ref(locks.pop(family % len(locks)))
        elif op == "e":
            want = _scan_lru_leaves(cache, 4 * pages)
            before = {n.id for n in cache._nodes()}
            cache.evict(4 * pages)
            assert sorted(before - {n.id for n in cache._nodes()}) == sorted(want)
        cache.check()


def test_a_leaf_unlocked_after_an_eviction_passed_it_over_is_evicted_later():
    cache = make_cache(page_size=4)
    x, y = [1] * 4, [2] * 4
    put(cache, x)
    put(cache, y)
    node = cache.match_prefix(x).last_node  # x: the most recent, then locked
    cache.inc_lock_ref(node)
    cache.match_prefix(y)
    assert cache.evict(8) == 4  # y goes; x, locked, is passed over
    cache.dec_lock_ref(node)
    assert cache.evict(8) == 4 and cache.total_size() == 0
    cache.check()


def test_a_leaf_evicted_is_never_evicted_again_from_an_older_record():
    cache = make_cache(page_size=4)
    x, y = [1] * 4, [2] * 4
    put(cache, x)
    node = cache.match_prefix(x).last_node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)  # x now has two records of the same access
    assert cache.evict(4) == 4 and cache.total_size() == 0
    put(cache, y)
    assert cache.evict(8) == 4  # y only: x's second record is skipped
    assert cache.total_size() == 0 and cache.allocator.num_free_pages == 32
    cache.check()
