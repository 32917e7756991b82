"""What `stats` reports of a scheduler: queues, pools, counters, and the drained-state
invariants when --check-invariants asks for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpprefill.scheduling.invariants import check_drained
from mpprefill.scheduling.kv_pools import kv_stats
from mpprefill.scheduling.req import ReqStatus

if TYPE_CHECKING:
    from mpprefill.scheduling.scheduler import Scheduler


def scheduler_stats(s: Scheduler) -> dict:
    return {
        "queues": {
            "bootstrap": len(s.reqs.bootstrap_queue),
            "waiting": len(s.reqs.waiting),
            "inflight": len(s.reqs.inflight_queue),
            "live": len(s.reqs.live),
            "running": sum(1 for r in s.reqs.live.values() if r.status == ReqStatus.RUNNING),
        },
        "load": load(s),
        "kv": {**kv_stats(s.allocator, s.tree), "evictable_tokens": s.tree.evictable_size()},
        "req_slots": {"free": s.req_pool.available_size(), "total": s.req_pool.size},
        "counters": s.metrics.to_dict(),
        "invariants": _invariants(s),
    }


def load(s: Scheduler) -> dict[str, int]:
    """SGLang's load figures: every request not yet finished, those of them waiting for
    their decode side or for admission, and the KV tokens requests hold (in use, not
    free and not evictable prefix cache)."""
    waiting = len(s.reqs.bootstrap_queue) + len(s.reqs.waiting)
    held = s.allocator.size - s.allocator.available_size() - s.tree.evictable_size()
    return {"num_reqs": len(s.reqs.live), "num_waiting_reqs": waiting, "num_tokens": held}


def _invariants(s: Scheduler) -> dict:
    """The drained-state checks, whenever the scheduler is idle."""
    if not s.args.check_invariants or s.reqs.live or s.forwards_in_flight:
        return {"checked": False}
    try:
        check_drained(s)
    except AssertionError as e:  # InvariantError is one
        return {"checked": True, "ok": False, "error": str(e)}
    return {"checked": True, "ok": True}
