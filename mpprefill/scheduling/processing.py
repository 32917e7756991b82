"""Result processing, KV sends, the inflight queue, release and aborts (scheduler side)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpprefill.disagg.planes import window_swa_pages
from mpprefill.disagg.sender import KVPoll
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.trace.tracer import clock_ns

if TYPE_CHECKING:
    from mpprefill.scheduling.batch import ScheduleBatch
    from mpprefill.worker.api import ForwardResult


class ResultProcessing:
    """Mixed into Scheduler; every method runs on the scheduler thread."""

    def retire_host_store_writes(self) -> None:
        """Finished host-store write-backs become matchable; runs before ingest."""
        if self.host_tier is not None:
            t0 = clock_ns()
            self.host_tier.retire()
            self.metrics.add_phase("host-retire", t0)

    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        t0 = clock_ns()
        result.wait_ready()
        self.metrics.add_phase("device-wait", t0, batch.seq)
        t0 = clock_ns()
        tokens = result.next_token_ids.tolist()
        finished = []
        for i, req in enumerate(batch.reqs):
            self._release_prefix_key(req)
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                if req.finished:
                    self._release_aborted(req)
                else:
                    self.send_kv_chunk(req, last=False, end_idx=batch.fill_lens[i])
                continue
            if req.finished:  # aborted while its final chunk ran
                self._release_aborted(req)
                continue
            req.output_ids.append(tokens[i])
            if req.return_logits:
                req.logits = result.logits[i].float().clone()
            self.tree.cache_unfinished_req(req)
            finished.append(req)
            req.status = ReqStatus.TRANSFERRING
            self.inflight_queue.append(req)
            self.send_kv_chunk(req, last=True)
        if finished and self.host_tier is not None:
            self.host_tier.write_back(finished)
        self.metrics.add_phase("P", t0, batch.seq)

    def _release_prefix_key(self, req: Req) -> None:
        """Its first computed page is (or is about to be) in the tree: others may match it."""
        key, req.prefix_key = req.prefix_key, None
        left = self.pending_prefix_keys.get(key, 0) - 1
        if left > 0:
            self.pending_prefix_keys[key] = left
        else:
            self.pending_prefix_keys.pop(key, None)

    def send_kv_chunk(self, req: Req, last: bool, end_idx: int | None = None) -> None:
        """Send KV [start_send_idx, end) of `req`; a non-final send stops on a page boundary."""
        start = req.start_send_idx
        end = len(req.fill_ids) if end_idx is None else end_idx
        if not last:
            end -= end % self.page_size
        if end < start or (end == start and not last):
            return
        slots = self.req_pool.req_to_token[req.req_pool_idx, start:end]
        page_indices = slots[:: self.page_size] // self.page_size
        if not req.sender.should_send_kv_chunk(len(page_indices), last):
            return
        req.start_send_idx = end
        first = req.output_ids[0] if last else None
        window = None
        if last and self.allocator.has_swa_pool:
            row = self.req_pool.req_to_token[req.req_pool_idx]
            window = window_swa_pages(self.allocator, row, end, self.model_config.sliding_window)
        req.sender.send(page_indices, last=last, first_token=first, state_indices=window)

    def maybe_send_cached_prefix_chunk(self, req: Req) -> None:
        """Early send: KV already in the cache goes out before the suffix is computed.

        NOTE: a page of the prefix may still be written by a forward in flight (the
        chunked request's previous chunk); the transfer waits on the KV write fence first.
        """
        cached_end = req.prefix_len
        if cached_end > req.start_send_idx:
            t0 = clock_ns()
            self.send_kv_chunk(req, last=False, end_idx=cached_end)
            self.metrics.add_phase("early-send", t0)

    def process_inflight_queue(self) -> None:
        t0 = clock_ns()
        keep = []
        for req in self.inflight_queue:
            state = req.sender.poll()
            if state == KVPoll.Success:
                self._release(req)
                self.finish(req)
            elif state == KVPoll.Failed:
                self._release(req)
                self.finish(req, f"KV transfer failed: {req.sender.failure_reason()}")
            else:
                keep.append(req)
        self.inflight_queue = keep
        self.metrics.add_phase("inflight", t0)

    def _release(self, req: Req) -> None:
        self.tree.cache_finished_req(req)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def _release_aborted(self, req: Req) -> None:
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
                self.fail(req, reason, release=False)
                return True
        if req.status == ReqStatus.TRANSFERRING:
            req.sender.abort()  # the inflight queue releases it on Failed
            return True
        req.sender.abort()
        self.finish(req, reason)  # released when its chunk in flight comes back
        if self.chunked_req is req and req.inflight_middle_chunks == 0:
            self._release_aborted(req)
        return True

    def fail_all(self, reason: str) -> int:
        """The worker is gone: every live request gets an error; pools are abandoned."""
        reqs = list(self.live.values())
        self.pending_prefix_keys.clear()
        for req in reqs:
            if req.sender is not None:
                req.sender.abort()
            self.finish(req, reason)
        self.bootstrap_queue, self.waiting, self.inflight_queue = [], type(self.waiting)(), []
        self.chunked_req = None
        return len(reqs)

    def fail(self, req: Req, reason: str, release: bool = True) -> None:
        if release and req.req_pool_idx is not None:
            self._release_aborted(req)
        self.finish(req, reason)

    def finish(self, req: Req, error: str | None = None) -> None:
        if req.finished:
            return
        req.status = ReqStatus.FAILED if error else ReqStatus.DONE
        req.error = error
        self.live.pop(req.rid, None)
        self.metrics.on_finish(req)
        self.on_finish(req)
