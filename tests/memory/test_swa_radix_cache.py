"""SwaRadixCache: window validity, SWA locks, eviction, cold pages, tombstone revival."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from mpprefill.memory.swa_radix_cache import SwaRadixCache, SwaTreeNode


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    req_pool_idx: int
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: SwaTreeNode
    cache_protected_len: int
    cached_tokens: int
    swa_evicted_len: int = 0
    done: bool = False


@dataclass
class Sim:
    """Drives the cache the way the scheduler does: admit, chunk, cache, release."""

    page_size: int = 4
    num_pages: int = 64
    num_swa_pages: int = 16
    window: int = 8
    chunk: int = 8
    disable: bool = False
    free: bool = False  # free_out_of_window
    reqs: list[FakeReq] = field(default_factory=list)
    locks: list[SwaTreeNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.alloc = SwaPagedAllocator(self.num_pages, self.page_size, self.num_swa_pages)
        self.pool = ReqToTokenPool(6, 256)
        args = (self.pool, self.alloc, self.page_size, self.window, self.disable, self.free)
        self.cache = SwaRadixCache(*args)

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx]

    def admit(self, prompt: list[int]) -> FakeReq | None:
        idx = self.pool.alloc()
        if idx is None:
            return None
        m = self.cache.match_prefix(prompt[:-1])
        self.cache.inc_lock_ref(m.last_node)
        self.pool.write(idx, 0, m.indices)
        n = len(m.indices)
        self.reqs.append(FakeReq(prompt, idx, prompt[:n], m.indices, m.last_node, n, n))
        return self.reqs[-1]

    def step(self, req: FakeReq) -> bool:
        p, ps = len(req.prefix_indices), self.page_size
        s = min(p + self.chunk, len(req.origin_input_ids))
        need = self.alloc.pages_needed(p, s)
        self.cache.evict((need - self.alloc.num_free_full_pages) * ps)
        self.cache.evict_swa((need - self.alloc.swa.num_free_pages) * ps)
        last = int(req.prefix_indices[-1]) if p else -1
        slots = self.alloc.alloc_extend([p], [s], [last])
        if slots is None:
            return False
        self.pool.write(req.req_pool_idx, p, slots)
        req.fill_ids = req.origin_input_ids[:s]
        self.cache.cache_unfinished_req(req)
        req.done = s == len(req.origin_input_ids)
        return True

    def run(self, req: FakeReq) -> None:
        while not req.done:
            assert self.step(req)
            check_all(self)

    def release(self, req: FakeReq) -> None:
        self.cache.cache_finished_req(req)
        self.pool.free(req.req_pool_idx)
        self.reqs.remove(req)

    def swa_used(self) -> int:
        return (self.num_swa_pages - self.alloc.swa.num_free_pages) * self.page_size

    def drain(self) -> None:
        for req in list(self.reqs):
            self.release(req)
        while self.locks:
            self.cache.dec_lock_ref(self.locks.pop())
        check_all(self)
        assert self.cache.swa_protected_size() == self.cache.protected_size() == 0
        self.cache.evict(10**9)
        assert self.cache.total_size() == self.cache.swa_total_size() == 0
        assert self.alloc.num_free_full_pages == self.num_pages
        assert self.alloc.swa.num_free_pages == self.num_swa_pages
        check_all(self)


def path_slots(cache: SwaRadixCache, node: SwaTreeNode) -> list[int]:
    parts = []
    while node is not cache.root:
        parts.insert(0, node.value.tolist())
        node = node.parent
    return [s for part in parts for s in part]


def swa_tokens(sim: Sim, cold: bool, below: int = 1 << 30) -> int:
    """Tokens of cached nodes (ending at or before `below`) with SWA KV, cold or warm."""
    live = [n for n in sim.cache._nodes() if not n.tombstone and n.end <= below]
    return sum(len(n.key) for n in live if n.swa_cold == cold)


def check_all(sim: Sim) -> None:
    sim.alloc.check()
    sim.pool.check()
    sim.cache.check()
    ps, owned = sim.page_size, []
    for req in sim.reqs:
        row, kv_len, protected = sim.row(req), len(req.fill_ids), req.cache_protected_len
        assert row[: len(req.prefix_indices)].tolist() == req.prefix_indices.tolist()
        assert path_slots(sim.cache, req.last_node) == row[:protected].tolist()
        window = row[max(0, kv_len - sim.window + 1) : kv_len]
        assert bool(sim.alloc.has_swa(window).all()), "a live request lost its window"
        owned += sorted(set((row[protected:kv_len] // ps).tolist()))
    tree = [int(s) // ps for n in sim.cache._nodes() for s in n.value[::ps]]
    free = sim.alloc.free_pages().tolist()
    assert sorted(tree + owned + free) == list(range(sim.num_pages)), "pages not partitioned"


def put(sim: Sim, tokens: list[int]) -> None:
    slots = sim.alloc.alloc_extend([0], [len(tokens)], [-1])
    present = sim.cache.insert(tokens, slots)
    aligned = len(tokens) - len(tokens) % sim.page_size
    sim.alloc.free(torch.cat([slots[:present], slots[aligned:]]))


def matched(sim: Sim, tokens: list[int]) -> int:
    m = sim.cache.match_prefix(tokens)
    assert m.last_node.end == len(m.indices)
    return len(m.indices)


A = list(range(100, 164))


def test_match_needs_the_window_before_its_end():
    sim = Sim()
    put(sim, A[:32])
    for n in (8, 16, 24):
        matched(sim, A[:n])  # nodes [0, 8) [8, 16) [16, 24) [24, 32)
    sim.locks.append(sim.cache.match_prefix(A[:32]).last_node)
    sim.cache.inc_lock_ref(sim.locks[-1])  # SWA-locks [24, 32) only
    matched(sim, A[:16])  # [16, 24) is now the LRU node without an SWA lock
    assert sim.cache.swa_protected_size() == 8
    assert sim.cache.evict_swa(1) == 8 and sim.cache.swa_total_size() == 24
    check_all(sim)
    assert matched(sim, A[:32]) == 32  # tombstone [16, 24) is before the window
    assert matched(sim, A[:28]) == 16  # window [20, 28) meets it
    assert matched(sim, A[:24]) == 16 and matched(sim, A[:12]) == 12
    sim.drain()


def test_tombstone_at_the_end():
    sim = Sim()
    put(sim, A[:16])
    matched(sim, A[:16])
    matched(sim, A[:8])  # [8, 16) is the LRU node
    assert sim.cache.evict_swa(4) == 8
    assert matched(sim, A[:16]) == 8  # window [0, 8) is whole
    assert sim.cache.evict_swa(4) == 8
    m = sim.cache.match_prefix(A[:16])
    assert len(m.indices) == 0 and m.last_node is sim.cache.root
    check_all(sim)
    sim.drain()


def test_locks_are_reversible_across_splits():
    sim = Sim(page_size=4, window=8)
    put(sim, A[:24])
    node = sim.cache.match_prefix(A[:24]).last_node
    sim.cache.inc_lock_ref(node)
    assert sim.cache.swa_protected_size() == 24  # one node, met by [16, 24)
    put(sim, A[:8] + [1] * 8)  # split at 8: the upper part is out of the window
    assert sim.cache.swa_protected_size() == 16 and sim.cache.swa_evictable_size() == 16
    put(sim, A[:20] + [2] * 4)  # split at 20: both parts stay locked
    other = sim.cache.match_prefix(A[:12]).last_node  # split at 12, locked at depth 12
    sim.cache.inc_lock_ref(other)
    check_all(sim)
    assert sim.cache.evict_swa(100) == 12  # [1] * 8 and [2] * 4 only
    sim.cache.dec_lock_ref(node)
    sim.cache.dec_lock_ref(other)
    with pytest.raises(RuntimeError):
        sim.cache.dec_lock_ref(other)
    assert all(not n.swa_locks for n in sim.cache._nodes())
    assert sim.cache.swa_protected_size() == 0 and sim.cache.swa_evictable_size() == 24
    check_all(sim)
    sim.drain()


def test_evict_swa_skips_locked_windows_in_lru_order():
    sim = Sim()
    x, y, z = [1] * 8, [2] * 8, [3] * 8
    for tokens in (x, y, z):
        put(sim, tokens)
    sim.locks.append(sim.cache.match_prefix(z).last_node)
    sim.cache.inc_lock_ref(sim.locks[-1])
    matched(sim, x)
    assert sim.cache.evict_swa(1) == 8 and matched(sim, y) == 0 and matched(sim, x) == 8
    assert sim.cache.evict_swa(100) == 8 and matched(sim, x) == 0
    assert sim.cache.evict_swa(100) == 0 and matched(sim, z) == 8
    assert sim.cache.swa_total_size() == 8 and sim.cache.total_size() == 24
    with pytest.raises(RuntimeError):  # no window to lock
        sim.cache.inc_lock_ref(sim.cache.root.children[(1,) * 4])
    check_all(sim)
    sim.drain()


@pytest.mark.parametrize("disable", [False, True])
def test_chunked_prompt_fits_a_small_swa_pool(disable):
    sim = Sim(page_size=4, num_pages=64, num_swa_pages=6, window=8, chunk=8, disable=disable)
    req = sim.admit(A)
    peak = 0
    while not req.done:
        assert sim.step(req)  # 16 SWA pages without freeing
        check_all(sim)
        peak = max(peak, sim.swa_used())
        if not disable:  # warm: the window, and a page more once the prompt is done
            warm = sim.window + (sim.page_size if req.done else 0)
            assert sim.cache.swa_total_size() == sim.swa_used()
            assert swa_tokens(sim, cold=False) == warm
    # freed at once without a tree; with one, the cold pages go as the pool fills up
    assert peak <= (sim.window + sim.chunk + sim.page_size if disable else 24) < len(A)
    assert req.swa_evicted_len == (52 if disable else 0)
    sim.release(req)
    if not disable:  # the same prompt again hits all of it but its last (partial) page
        again = sim.admit(A)
        assert again.cached_tokens == 60
        sim.release(again)
    sim.drain()


def test_out_of_window_pages_go_first_and_a_match_warms_them():
    sim = Sim(num_swa_pages=32)
    sim.run(sim.admit(A[:24] + [9]))  # [0, 24) cached; [0, 12) left its window (and a page)
    assert sim.cache.swa_total_size() == 24 and swa_tokens(sim, cold=True) == 12
    sim.release(sim.reqs[0])
    put(sim, [5] * 8)  # older than nothing: accessed after the cold pages
    freed = sim.cache.evict_swa(4)  # whole nodes: at least 4 tokens
    assert freed >= 4 and swa_tokens(sim, cold=True) == 12 - freed  # cold goes first
    assert matched(sim, [5] * 8) == 8
    req = sim.admit(A[:40])
    assert req.cached_tokens == 24  # its window [16, 24) was warm
    sim.run(req)
    assert swa_tokens(sim, cold=True, below=24) == 0  # the matched prefix is warm again
    sim.drain()


def test_revive_unlocked_tombstones():
    sim = Sim()
    sim.run(sim.admit(A[:17]))
    sim.release(sim.reqs[0])
    assert sim.cache.evict_swa(100) == 16 and matched(sim, A) == 0  # all tombstones now
    held = sim.num_pages - sim.alloc.num_free_full_pages
    req = sim.admit(A[:17])
    assert req.cached_tokens == 0
    sim.run(req)
    assert matched(sim, A[:16]) == 16 and sim.cache.total_size() == 16
    assert sim.num_pages - sim.alloc.num_free_full_pages == held + 1  # its tail page
    sim.drain()


def test_revive_locked_tombstones_keeps_both_rows_valid():
    sim = Sim(num_swa_pages=32)
    long = sim.admit(A[:40])
    sim.run(long)
    assert sim.cache.evict_swa(100) == 32  # its own [0, 32): out of its window, still locked
    assert matched(sim, A[:16]) == 0
    before = sim.row(long)[:40].clone()
    short = sim.admit(A[:16] + [7, 7, 7])
    sim.run(short)  # check_all: its window [12, 19) has SWA
    assert sim.row(long)[:40].tolist() == before.tolist()
    assert sim.row(short)[:16].tolist() == before[:16].tolist()
    assert matched(sim, A[:16]) == 16
    sim.drain()
