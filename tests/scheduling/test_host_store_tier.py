"""HostTier on a real radix cache and KV pool: batched vs per-request write-back, loads."""

from __future__ import annotations

import threading

import torch

from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.host.store import HostKVStore
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.radix_cache import RadixCache
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.scheduling.host_tier import HostTier
from mpprefill.scheduling.req import Req

PS = 4


class Device:
    def __init__(self, num_pages: int = 32):
        self.pool = ReqToTokenPool(8, 128)
        self.alloc = PagedTokenAllocator(num_pages, PS)
        self.tree = RadixCache(self.pool, self.alloc, PS)
        self.kv = KVCache(2, num_pages * PS, 2, 8)
        self.kv.buffer.copy_(torch.randn(self.kv.buffer.shape))

    def tier(self, batched: bool = True, host_pages: int = 64) -> HostTier:
        store = HostKVStore(host_pages * PS, PS, self.kv)
        return HostTier(store, self.tree, self.alloc, self.kv, batched)

    def finish(self, ids: list[int]) -> Req:
        """A request whose final chunk just ran, cached as result processing caches it."""
        req = Req(f"r{self.pool.available_size()}", list(ids))
        match = self.tree.match_prefix(ids)
        self.tree.inc_lock_ref(match.last_node)
        p = len(match.indices)
        req.prefix_indices, req.last_node, req.cache_protected_len = (
            match.indices,
            match.last_node,
            p,
        )
        req.req_pool_idx = self.pool.alloc()
        out = self.alloc.alloc_extend([p], [len(ids)], [int(match.indices[-1]) if p else -1])
        self.pool.write(req.req_pool_idx, 0, match.indices)
        self.pool.write(req.req_pool_idx, p, out)
        req.fill_ids = list(ids)
        self.tree.cache_unfinished_req(req)
        return req

    def release(self, req: Req) -> None:
        self.tree.cache_finished_req(req)
        self.pool.free(req.req_pool_idx)


def prompts() -> list[list[int]]:
    system = list(range(1, 3 * PS + 1))
    return [system + [100 + i] * (2 * PS + i) for i in range(3)] + [[500] * (2 * PS + 1)]


def written_back_store(batched: bool) -> tuple[HostTier, list[Req], int]:
    torch.manual_seed(0)
    dev = Device()
    reqs = [dev.finish(p) for p in prompts()]
    tier = dev.tier(batched)
    tier.write_back(reqs)
    tier.retire(wait=True)
    tier.check()
    for req in reqs:  # every committed page is on the host, equal to the device's
        committed = req.cache_protected_len
        held = tier.store.match(req.fill_ids[:committed])
        assert len(held) * PS == committed
        device = dev.kv.gather(req.prefix_indices[:committed])
        assert torch.equal(tier.store.kv.gather(tier.store.slots_of(held)), device)
    return tier, reqs, len(tier.staging_log)


def test_batched_writeback_is_one_write_and_byte_identical_to_per_request():
    batched, reqs, n_batched = written_back_store(True)
    single, _, n_single = written_back_store(False)
    assert n_batched == 1
    assert n_single == len(reqs)
    held = torch.cat([batched.store.slots_of(list(batched.store.index.entries()))]).sort().values
    assert torch.equal(
        held, single.store.slots_of(list(single.store.index.entries())).sort().values
    )
    a, b = (t.store.kv.gather(held).view(torch.uint8) for t in (batched, single))
    assert torch.equal(a, b)
    system, own, other = 3 * PS, 2 * PS, 2 * PS  # system pages are planned once
    assert len(batched.store.index) * PS == system + 3 * own + other


def test_host_pages_load_into_the_device_and_join_the_tree():
    dev = Device()
    tier = dev.tier()
    ids = list(range(1, 5 * PS + 2))
    req = only_on_the_host(dev, tier, ids)
    expect = dev.kv.gather(req.prefix_indices[: 5 * PS]).clone()
    dev.kv.buffer.zero_()
    match, left = tier.match_prefix(ids, 5 * PS, lambda: 100, partial=False)
    tier.wait_loads()
    assert left == 0 and len(match.indices) == 5 * PS
    assert torch.equal(dev.kv.gather(match.indices), expect)
    assert tier.metrics.host_loaded_tokens == 5 * PS
    assert dev.tree.evictable_size() == 5 * PS  # in the tree, unlocked
    dev.tree.check()
    dev.alloc.check()


def test_loads_respect_the_budget_and_keep_the_device_match():
    dev = Device(num_pages=6)
    tier = dev.tier()
    ids = list(range(1, 4 * PS + 2))
    only_on_the_host(dev, tier, ids)
    dev.release(dev.finish(ids[: 2 * PS]))  # the first two pages are on the device again
    dev.release(dev.finish([900] * 4 * PS))  # a more recent entry fills the pool
    assert dev.alloc.num_free_pages == 0
    device_prefix = dev.tree.match_prefix(ids).indices.clone()
    assert len(device_prefix) == 2 * PS
    match, left = tier.match_prefix(ids, 4 * PS, lambda: 1, partial=False)
    tier.wait_loads()
    assert left == 2 and torch.equal(match.indices, device_prefix)  # not all fit: none loaded
    match, left = tier.match_prefix(ids, 4 * PS, lambda: 2, partial=False)
    tier.wait_loads()
    assert left == 0 and len(match.indices) == 4 * PS
    assert torch.equal(match.indices[: 2 * PS], device_prefix)  # LRU, but locked while loading
    assert len(dev.tree.match_prefix([900] * 4 * PS).indices) == 0
    dev.tree.check()


def test_partial_load_takes_what_the_budget_allows():
    dev = Device()
    tier = dev.tier()
    ids = list(range(1, 4 * PS + 2))
    only_on_the_host(dev, tier, ids)
    match, left = tier.match_prefix(ids, 4 * PS, lambda: 1, partial=True)
    tier.wait_loads()
    assert len(match.indices) == PS and left == 3


def test_flush_waits_for_the_write_backs_in_flight_then_drops_the_store():
    dev = Device()
    tier = dev.tier()
    reqs = [dev.finish(p) for p in prompts()]
    gate = threading.Event()
    tier.store.copier.load([], before=lambda: gate.wait(10))  # the copy thread is busy
    tier.write_back(reqs)
    for req in reqs:
        dev.release(req)
    assert tier.store.writes_in_flight == 1 and dev.tree.protected_size() > 0  # pages read
    flushed = []
    flusher = threading.Thread(target=lambda: flushed.append(tier.flush()))
    flusher.start()
    flusher.join(0.2)
    assert flusher.is_alive() and not flushed  # it waits for the copy
    gate.set()
    flusher.join(10)
    system, own, other = 3 * PS, 2 * PS, 2 * PS
    assert flushed == [system + 3 * own + other]
    assert len(tier.store.index) == 0 and tier.store.writes_in_flight == 0
    assert dev.tree.protected_size() == 0  # the write-back's locks went with it
    assert tier.match_prefix(prompts()[0], 5 * PS, lambda: 100, partial=False)[1] == 0
    tier.check()
    dev.tree.flush()
    dev.alloc.check()
    assert dev.alloc.available_size() == dev.alloc.size


def only_on_the_host(dev, tier, ids: list[int]) -> Req:
    """Compute ids, write their pages back, then drop them from the device cache (their
    pages' KV stays in the buffer until something overwrites it)."""
    req = dev.finish(ids)
    tier.write_back([req])
    tier.retire(wait=True)
    dev.release(req)
    dev.tree.flush()
    return req
