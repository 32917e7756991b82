"""Where each live request stands, and how it leaves: the queues, the transfers in flight,
finish, fail, abort and the release of its pool row, pages and tree lock.

One component, owned by the scheduler: admission moves requests along the queues, result
processing hands finished ones to `inflight_queue`, and the front aborts through `abort`.
Every method runs on the scheduler thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mpprefill.disagg.sender import KVPoll
from mpprefill.memory.allocator import PagedTokenAllocator
from mpprefill.memory.radix_cache import RadixCache
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.scheduling.metrics import SchedulerMetrics
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.trace.tracer import clock_ns


class Lifecycle:
    def __init__(
        self,
        tree: RadixCache,
        allocator: PagedTokenAllocator,
        req_pool: ReqToTokenPool,
        metrics: SchedulerMetrics,
        on_finish: Callable[[Req], None],
    ):
        self.tree = tree
        self.allocator = allocator
        self.req_pool = req_pool
        self.metrics = metrics
        self.on_finish = on_finish
        self.live: dict[str, Req] = {}  # every request not yet finished, by rid
        self.incoming: deque[Req] = deque()  # handed in, not yet validated
        self.bootstrap_queue: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.inflight_queue: list[Req] = []  # computed; their KV is on its way
        self.chunked_req: Req | None = None  # the one request whose prefill is split
        self.pending_prefix_keys: dict[tuple, int] = {}  # first uncached pages in flight

    def release_prefix_key(self, req: Req) -> None:
        """Its first computed page is (or is about to be) in the tree: others may match it."""
        key, req.prefix_key = req.prefix_key, None
        left = self.pending_prefix_keys.get(key, 0) - 1
        if left > 0:
            self.pending_prefix_keys[key] = left
        else:
            self.pending_prefix_keys.pop(key, None)

    def process_inflight_queue(self) -> None:
        """Finish the requests whose transfer ended: release, then reply.

        NOTE: a failed or aborted transfer's pages may still be read by the backend's
        thread (a copy under way); they are released once its sender is settled, and the
        reply goes out after the release, so a rid reused at once finds nothing of it.
        """
        t0 = clock_ns()
        keep = []
        for req in self.inflight_queue:
            state = req.sender.poll()
            if state in (KVPoll.Success, KVPoll.Failed) and not req.sender.settled():
                keep.append(req)
            elif state == KVPoll.Success:
                self.release_finished(req)
                self.finish(req)
            elif state == KVPoll.Failed:
                self.release_finished(req)
                self.finish(req, f"KV transfer failed: {req.sender.failure_reason()}")
            else:
                keep.append(req)
        self.inflight_queue = keep
        self.metrics.add_phase("inflight", t0)

    def release_finished(self, req: Req) -> None:
        self.tree.cache_finished_req(req)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def release_aborted(self, req: Req) -> None:
        """Free a partly computed request once none of its chunks is in flight."""
        if req.inflight_middle_chunks > 0 or req.req_pool_idx is None:
            return
        if self.chunked_req is req:
            self.chunked_req = None
        row = self.req_pool.req_to_token[req.req_pool_idx, : len(req.fill_ids)]
        own = row[req.cache_protected_len :]
        if len(own):
            self.allocator.free(own)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
            req.last_node = None
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def abort(self, rid: str, reason: str = "aborted") -> bool:
        req = self.live.get(rid)
        if req is None:
            return False
        for queue in (self.bootstrap_queue, self.waiting):
            if req in queue:
                queue.remove(req)
                req.sender.abort()
                self.finish(req, reason)
                return True
        if req.status == ReqStatus.TRANSFERRING:
            req.sender.abort()  # the inflight queue releases it, then replies
            return True
        req.sender.abort()
        self.finish(req, reason)  # released when its chunk in flight comes back
        if self.chunked_req is req and req.inflight_middle_chunks == 0:
            self.release_aborted(req)
        return True

    def fail_all(self, reason: str) -> None:
        """The worker is gone: every live request gets an error; pools are abandoned."""
        self.pending_prefix_keys.clear()
        for req in list(self.live.values()):
            if req.sender is not None:
                req.sender.abort()
            self.finish(req, reason)
        self.bootstrap_queue, self.waiting, self.inflight_queue = [], deque(), []
        self.chunked_req = None

    def finish(self, req: Req, error: str | None = None) -> None:
        if req.finished:
            return
        req.status = ReqStatus.FAILED if error else ReqStatus.DONE
        req.error = error
        self.live.pop(req.rid, None)
        self.metrics.on_finish(req)
        self.on_finish(req)
