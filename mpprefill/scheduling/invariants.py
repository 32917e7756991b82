"""DESIGN.md's invariants after a drain, as assertions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpprefill.scheduling.scheduler import Scheduler


class InvariantError(AssertionError):
    pass


def check_drained(s: Scheduler, flush: bool = False) -> dict[str, int]:
    """Pools, cache and queues after a drain; with flush, the cache is emptied first."""
    _expect(not s.live, f"{len(s.live)} requests still live")
    _expect(s.forwards_in_flight == 0, "a forward is still in flight")
    _expect(s.chunked_req is None, "a chunked request is pending")
    _expect(not s.pending_prefix_keys, "prefix keys still marked in flight")
    for q in ("incoming", "bootstrap_queue", "waiting", "inflight_queue"):
        _expect(not getattr(s, q), f"{q} is not empty")
    s.req_pool.check()
    s.allocator.check()
    s.tree.check()
    if s.host_tier is not None:
        s.host_tier.check()  # valid with writes in flight: they hold their host pages
    _expect(s.req_pool.available_size() == s.req_pool.size, "req_to_token rows still held")
    _expect(s.tree.protected_size() == 0, "cache nodes still locked")
    free, held = s.allocator.available_size(), s.tree.total_size()
    _expect(
        free + held == s.allocator.size,
        f"KV pages leaked: free {free} + cached {held} != {s.allocator.size}",
    )
    swa = getattr(s.allocator, "swa", None)
    if swa is not None:
        free, held = swa.available_size(), s.tree.swa_total_size()
        _expect(
            free + held == swa.size,
            f"SWA pages leaked: free {free} + cached {held} != {swa.size}",
        )
    if flush:
        s.tree.flush()
        _expect(s.allocator.available_size() == s.allocator.size, "KV not free after flush")
        _expect(swa is None or swa.available_size() == swa.size, "SWA KV not free after flush")
    return {"free_tokens": s.allocator.available_size(), "cached_tokens": s.tree.total_size()}


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)
