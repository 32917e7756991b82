"""HostTier over a sliding-window cache: checkpoints written back next to the full pages,
hits that load both, batched staging byte-identical to per-request staging."""

from __future__ import annotations

import pytest
import torch

from mpprefill.memory.host.store import HostKVStore
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from mpprefill.memory.swa_radix_cache import SwaRadixCache
from mpprefill.scheduling.host_tier import HostTier
from mpprefill.scheduling.req import Req

PS, W = 4, 9  # the window before m is [m - 8, m): two pages when m is page-aligned


class SwaDevice:
    """A device pool with layers 0, 2 sliding, their own pool, and a SwaRadixCache."""

    def __init__(self, num_pages: int = 48, num_swa_pages: int = 48):
        self.pool = ReqToTokenPool(8, 256)
        self.alloc = SwaPagedAllocator(num_pages, PS, num_swa_pages)
        self.tree = SwaRadixCache(self.pool, self.alloc, PS, W)
        self.kv = KVCache(
            3, num_pages * PS, 2, 8, swa_layers=(0, 2), num_swa_slots=num_swa_pages * PS
        )
        self.kv.storage.copy_(torch.randn(self.kv.storage.shape))
        self.reqs = 0

    def tier(self, batched: bool = True, host_pages: int = 64) -> HostTier:
        store = HostKVStore(host_pages * PS, PS, self.kv)
        return HostTier(store, self.tree, self.alloc, self.kv, batched)

    def finish(self, ids: list[int], tier: HostTier | None = None) -> Req:
        """A request whose one chunk just ran, cached as result processing caches it."""
        self.reqs += 1
        req = Req(f"r{self.reqs}", list(ids))
        limit = (len(ids) - 1) // PS * PS
        if tier is None:
            match = self.tree.match_prefix(ids[:limit])
        else:
            match, _ = tier.match_prefix(ids, limit, lambda: 100, partial=True)
            tier.wait_loads()
        self.tree.inc_lock_ref(match.last_node)
        p = len(match.indices)
        req.prefix_indices, req.last_node = match.indices, match.last_node
        req.cache_protected_len = req.cached_tokens = p
        req.req_pool_idx = self.pool.alloc()
        self.pool.write(req.req_pool_idx, 0, match.indices)
        last = int(match.indices[-1]) if p else -1
        self.pool.write(req.req_pool_idx, p, self.alloc.alloc_extend([p], [len(ids)], [last]))
        req.fill_ids = list(ids)
        self.tree.cache_unfinished_req(req)
        return req

    def release(self, req: Req) -> None:
        self.tree.cache_finished_req(req)
        self.pool.free(req.req_pool_idx)

    def swa(self, slots: torch.Tensor) -> torch.Tensor:
        return self.kv.swa_buffer.index_select(2, self.alloc.translate(slots))

    def check(self, tier: HostTier) -> None:
        self.alloc.check()
        self.tree.check()
        tier.check()


def system(n: int = 10 * PS) -> list[int]:
    return list(range(1, n + 1))


def prompts() -> list[list[int]]:
    s = system()
    return [s + [100 + i] * (2 * PS + i) for i in range(3)] + [[500] * (3 * PS + 1)]


def written_back(batched: bool) -> tuple[SwaDevice, HostTier, list[Req]]:
    torch.manual_seed(0)
    dev = SwaDevice()
    tier = dev.tier(batched)
    reqs = [dev.finish(p) for p in prompts()]
    tier.write_back(reqs)
    tier.retire(wait=True)
    dev.check(tier)
    return dev, tier, reqs


def host_swa_pages(tier: HostTier, ids: list[int]) -> list[int]:
    """Prompt pages of ids whose host entry holds SWA KV."""
    chain = tier.store.index.walk(ids, ready_only=True)
    return [i for i, e in enumerate(chain) if e.swa_page >= 0]


def test_write_back_stores_full_pages_and_the_last_window_of_swa():
    dev, tier, reqs = written_back(True)
    for req in reqs:
        c = req.cache_protected_len
        held = tier.store.match(req.fill_ids[:c])
        assert len(held) * PS == c
        want = dev.kv.buffer.index_select(2, req.prefix_indices[:c])
        assert torch.equal(tier.store.kv.gather(tier.store.slots_of(held)), want)
        window = list(range((c - W + 1) // PS, c // PS))  # [c - 8, c): two pages
        assert set(window) <= set(host_swa_pages(tier, req.fill_ids[:c]))
        slots = req.prefix_indices[window[0] * PS : c]
        got = tier.store.swa_kv.gather(tier.store.swa_slots_of(held[window[0] :]))
        assert torch.equal(got, dev.swa(slots))
    # windows before each committed end (pages 10-11 of three prompts, 1-2 of the last)
    # and before page 10, where the second and third prompts left the first one's chain
    shared = host_swa_pages(tier, system())
    assert shared == [8, 9]
    swa_pages = tier.store.swa_pages
    assert swa_pages.num_pages - swa_pages.num_free_pages == 3 * 2 + 2 + 2
    assert len(tier.store.index) == 10 + 3 * 2 + 3


def test_batched_swa_staging_is_one_write_and_byte_identical_to_per_request():
    _, batched, reqs = written_back(True)
    _, single, _ = written_back(False)
    assert len(batched.staging_log) == 1 and len(single.staging_log) == len(reqs)
    for tier in (batched, single):
        entries = sorted(tier.store.index.entries(), key=lambda e: e.page)
        assert [e.page for e in entries] == sorted(e.page for e in entries)
    a = {e.id: e for e in batched.store.index.entries()}
    b = {e.id: e for e in single.store.index.entries()}
    assert [(e.page, e.swa_page) for e in a.values()] == [(e.page, e.swa_page) for e in b.values()]
    for pool in ("kv", "swa_kv"):
        x = getattr(batched.store, pool).buffer.view(torch.uint8)
        y = getattr(single.store, pool).buffer.view(torch.uint8)
        assert torch.equal(x, y)


def only_on_the_host(dev: SwaDevice, tier: HostTier, ids: list[int]) -> torch.Tensor:
    """Compute ids, write them back, drop them from the device; the KV they had."""
    req = dev.finish(ids)
    full = dev.kv.buffer.index_select(2, req.prefix_indices[: req.cache_protected_len]).clone()
    tier.write_back([req])
    tier.retire(wait=True)
    dev.release(req)
    dev.tree.flush()
    dev.kv.storage.zero_()
    return full


def test_a_host_hit_loads_full_pages_and_the_window_and_tombstones_the_rest():
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(6 * PS) + [7]
    full = only_on_the_host(dev, tier, ids)
    window_host = tier.store.swa_kv.gather(tier.store.swa_slots_of(tier.store.match(ids)[4:6]))
    match, left = tier.match_prefix(ids, 6 * PS, lambda: 100, partial=False)
    tier.wait_loads()
    assert left == 0 and len(match.indices) == 6 * PS  # crosses the window: 24 > W
    assert torch.equal(dev.kv.buffer.index_select(2, match.indices), full)
    assert torch.equal(dev.swa(match.indices[4 * PS :]), window_host)
    assert not bool(dev.alloc.has_swa(match.indices[: 4 * PS]).any())  # full KV only
    assert dev.tree.swa_total_size() == 2 * PS and dev.tree.total_size() == 6 * PS
    assert tier.metrics.host_loaded_tokens == 6 * PS
    dev.check(tier)


def test_a_hit_without_a_host_checkpoint_stops_where_one_is():
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(8 * PS) + [7]
    only_on_the_host(dev, tier, ids)
    shorter = system(5 * PS) + [9] * 5  # the host holds its 5 pages but no window at 20
    assert host_swa_pages(tier, shorter) == []
    match, left = tier.match_prefix(shorter, 5 * PS, lambda: 100, partial=False)
    tier.wait_loads()
    assert len(match.indices) == 0 and left == 0
    dev.check(tier)


def test_the_window_straddles_device_and_host_pages():
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(7 * PS) + [7]
    full = only_on_the_host(dev, tier, ids)
    head = dev.finish(system(5 * PS) + [8])  # device holds pages 0-4 again, window at 20
    dev.release(head)
    device_head = dev.tree.match_prefix(ids[: 5 * PS]).indices.clone()
    assert len(device_head) == 5 * PS
    swa_before = dev.swa(device_head[4 * PS :]).clone()
    match, left = tier.match_prefix(ids, 7 * PS, lambda: 100, partial=False)
    tier.wait_loads()
    assert left == 0 and len(match.indices) == 7 * PS
    assert torch.equal(match.indices[: 5 * PS], device_head)  # kept, not reloaded
    assert torch.equal(dev.kv.buffer.index_select(2, match.indices[5 * PS :]), full[:, :, 20:])
    # the window [20, 28) of 28: page 5-6 loaded, page 4 ... from the device match
    assert torch.equal(dev.swa(device_head[4 * PS :]), swa_before)
    assert bool(dev.alloc.has_swa(match.indices[5 * PS :]).all())
    assert tier.metrics.host_loaded_tokens == 2 * PS
    dev.check(tier)


def test_loaded_pages_revive_device_tombstones_inside_the_window():
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(6 * PS) + [7]
    only_on_the_host(dev, tier, ids)
    req = dev.finish(ids)  # computed again on the device
    dev.release(req)
    assert dev.tree.evict_swa(10**6) == 6 * PS  # every page tombstoned, full KV kept
    assert len(dev.tree.match_prefix(ids[: 6 * PS]).indices) == 0
    held = dev.tree.total_size()
    match, _ = tier.match_prefix(ids, 6 * PS, lambda: 100, partial=False)
    tier.wait_loads()
    assert len(match.indices) == 6 * PS and dev.tree.total_size() == held
    assert dev.tree.swa_total_size() == 2 * PS  # the window's pages hold SWA KV again
    dev.check(tier)


@pytest.mark.parametrize(
    "budget, partial, loaded",
    [(5, False, 0), (5, True, 0), (6, False, 6)],  # a hit may end only at a checkpoint
)
def test_loads_respect_the_budget(budget, partial, loaded):
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(6 * PS) + [7]
    only_on_the_host(dev, tier, ids)
    match, left = tier.match_prefix(ids, 6 * PS, lambda: budget, partial=partial)
    tier.wait_loads()
    assert len(match.indices) == loaded * PS and left == (6 if loaded == 0 else 0)
    dev.check(tier)
