"""DESIGN.md's invariants after a drain, as assertions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpprefill.memory.allocator import PagedTokenAllocator
    from mpprefill.memory.radix_cache import RadixCache
    from mpprefill.scheduling.scheduler import Scheduler


class InvariantError(AssertionError):
    pass


def check_drained(s: Scheduler, flush: bool = False) -> None:
    """Pools, cache and queues after a drain; with flush, the cache is emptied first."""
    _check_idle(s)
    s.req_pool.check()
    s.allocator.check()
    s.tree.check()
    if s.host_tier is not None:
        s.host_tier.retire(wait=True)  # a drain includes the host copies (they hold locks)
        s.host_tier.check()
    _expect(s.req_pool.available_size() == s.req_pool.size, "req_to_token rows still held")
    _expect(s.tree.protected_size() == 0, "cache nodes still locked")
    _check_pools(s.allocator, s.tree)
    if flush:
        _check_flush(s.allocator, s.tree)


def _check_idle(s: Scheduler) -> None:
    reqs = s.reqs
    _expect(not reqs.live, f"{len(reqs.live)} requests still live")
    _expect(s.forwards_in_flight == 0, "a forward is still in flight")
    _expect(reqs.chunked_req is None, "a chunked request is pending")
    _expect(not reqs.pending_prefix_keys, "prefix keys still marked in flight")
    for q in ("incoming", "bootstrap_queue", "waiting", "inflight_queue"):
        _expect(not getattr(reqs, q), f"{q} is not empty")


def _check_pools(allocator: PagedTokenAllocator, tree: RadixCache) -> None:
    """Every page is free or cached, in each pool (the SWA one is empty without SWA layers)."""
    _expect_no_leak("KV", allocator.available_size(), tree.total_size(), allocator.size)
    swa_free = allocator.swa_available_size()
    _expect_no_leak("SWA", swa_free, tree.swa_total_size(), allocator.swa_size)


def _check_flush(allocator: PagedTokenAllocator, tree: RadixCache) -> None:
    tree.flush()
    _expect(allocator.available_size() == allocator.size, "KV not free after flush")
    _expect(allocator.swa_available_size() == allocator.swa_size, "SWA KV not free after flush")


def _expect_no_leak(pool: str, free: int, held: int, total: int) -> None:
    _expect(free + held == total, f"{pool} pages leaked: free {free} + cached {held} != {total}")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)
