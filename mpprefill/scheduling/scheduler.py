"""The prefill scheduler: ingest, bootstrap, admission, batch build, forward hand-off.

Where each request stands and how it leaves (queues, transfers in flight, finish, abort,
release) is `lifecycle.py`; the six loops that order these steps live in `loops.py`. The
front (a socket server or the offline engine) hands requests in through `recv_requests`
and gets them back through `on_finish`; the worker sees tensors only (`worker.api`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from mpprefill.config import ServerArgs
from mpprefill.disagg.plane_map import window_swa_pages
from mpprefill.disagg.sender import KVPoll
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.model import ModelConfig
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import to_host
from mpprefill.scheduling.batch import ForwardSnapshot, ScheduleBatch, build_forward_batch
from mpprefill.scheduling.host_tier import make_host_tier
from mpprefill.scheduling.kv_pools import add_swa_slots, make_kv_pools, prompt_fits, reclaim
from mpprefill.scheduling.lifecycle import Lifecycle
from mpprefill.scheduling.metrics import SchedulerMetrics
from mpprefill.scheduling.prefill_adder import AddResult, PrefillAdder
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.trace.tracer import clock_ns, get_tracer
from mpprefill.worker.api import ForwardResult, Worker

if TYPE_CHECKING:
    from mpprefill.disagg.transfer import TransferBackend


NO_ROOM = (
    "missing bootstrap_room: the {backend} transfer backend sends a request's KV to the decode"
    " server that registers its room; send requests through a PD router (it adds"
    " bootstrap_host, bootstrap_port and bootstrap_room), or serve with"
    " --disaggregation-transfer-backend fake to prefill without a decode side"
)


class Flushed(NamedTuple):
    """Tokens a cache flush dropped, per tier."""

    device: int
    host: int | None  # None: no host tier


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        model_config: ModelConfig,
        worker: Worker,
        transfer: TransferBackend,
        on_finish: Callable[[Req], None] | None = None,
        recv_requests: Callable[[], list[Req]] | None = None,
        wait_for_requests: Callable[[float], None] = time.sleep,
    ):
        """`recv_requests()` returns the requests that arrived since the last call;
        `wait_for_requests(s)` waits up to s seconds for more (the front's socket)."""
        self.args, self.model_config = args, model_config
        self.page_size = args.page_size
        self.context_len = args.context_len(model_config.max_position_embeddings)
        rows = max(2 * args.max_running_requests, 64)
        self.req_pool = ReqToTokenPool(rows, self.context_len)
        self.allocator, self.tree = make_kv_pools(args.pool_config(), model_config, self.req_pool)
        self.worker = worker
        self.transfer = transfer
        self.batch_seq = 0
        self.forwards_in_flight = 0
        self._mailbox_mark = worker.mailbox_bytes
        self.metrics = SchedulerMetrics()
        self.reqs = Lifecycle(
            self.tree, self.allocator, self.req_pool, self.metrics, on_finish or (lambda r: None)
        )
        self.host_tier = make_host_tier(
            args.host_tier_config(), self.tree, self.allocator, worker, self.metrics
        )
        self.recv_requests = recv_requests or list
        self.wait_for_requests = wait_for_requests
        # NOTE: the backend keeps its per-layer counter only where layer-wise send can work
        self.layerwise = getattr(transfer, "layers", None) is not None

    # ---- bookkeeping -------------------------------------------------------------------

    def validate(self, req: Req) -> None:
        """Raise ValueError for a request this server can never finish."""
        ids = req.origin_input_ids
        if not ids:
            raise ValueError("empty input_ids")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} outside the vocabulary [0, {vocab})")
        if len(ids) > self.context_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens exceeds the context length {self.context_len}"
            )
        too_big = prompt_fits(self.allocator, len(ids), self.args.chunked_prefill_size != -1)
        if too_big is not None:
            raise ValueError(too_big)

    def add_request(self, req: Req) -> None:
        self.validate(req)
        if req.bootstrap_room is None and self.transfer.needs_bootstrap_room:
            raise ValueError(NO_ROOM.format(backend=self.transfer.name))
        req.sender = self.transfer.create_sender(req)
        req.status = ReqStatus.BOOTSTRAPPING
        self.reqs.live[req.rid] = req
        self.reqs.bootstrap_queue.append(req)

    def flush_caches(self) -> Flushed:
        """Drop the prefix cache and the host tier under it; the caller makes sure nothing
        is live. The host tier's copies in flight end first: write-backs lock tree nodes,
        and a load may still read host pages."""
        host = None
        if self.host_tier is not None:
            self.host_tier.retire(wait=True)
        device = self.tree.total_size()
        self.tree.flush()
        if self.host_tier is not None:
            host = self.host_tier.flush()
        return Flushed(device, host)

    def idle(self, busy: bool) -> None:
        """Between iterations: return at once when busy, else wait briefly for requests."""
        if busy or self.reqs.incoming:
            return
        self.wait_for_requests(0.0005 if self.reqs.live else 0.02)

    # ---- loop steps ----------------------------------------------------------------------

    def retire_host_store_writes(self) -> None:
        """Finished host-store write-backs become matchable; runs before ingest."""
        if self.host_tier is not None:
            t0 = clock_ns()
            self.host_tier.retire()
            self.metrics.add_phase("host-retire", t0)

    def ingest_requests(self) -> None:
        incoming = self.reqs.incoming
        incoming.extend(self.recv_requests())
        while incoming:
            req = incoming.popleft()
            try:
                self.add_request(req)
            except ValueError as e:
                self.reqs.finish(req, str(e))

    def pop_bootstrapped(self) -> None:
        self.transfer.raise_if_dead()  # no request could leave: the server must not go on
        keep, now = [], time.monotonic()
        for req in self.reqs.bootstrap_queue:
            state = req.sender.poll()
            if state == KVPoll.WaitingForInput:
                req.start_send_idx = req.sender.pop_decode_prefix_len()
                req.sender.init(cdiv(req.prompt_len - req.start_send_idx, self.page_size))
                req.status = ReqStatus.WAITING
                self.reqs.waiting.append(req)
            elif state == KVPoll.Failed:
                self.metrics.num_bootstrap_failed += 1
                reason = f"bootstrap failed: {req.sender.failure_reason()}"
                self.reqs.finish(req, reason)
            elif now - req.arrival_time > self.args.bootstrap_timeout:
                self.metrics.num_bootstrap_failed += 1
                req.sender.abort()
                self.reqs.finish(req, "bootstrap timed out")
            else:
                keep.append(req)
        self.reqs.bootstrap_queue = keep

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        t0 = clock_ns()
        reqs = self.reqs
        chunked = reqs.chunked_req
        if chunked is not None and chunked.finished:  # aborted; released when it returns
            chunked = reqs.chunked_req = None
        if chunked is not None:
            self.tree.cache_unfinished_req(chunked)  # its previous chunk joins the tree
        adder = PrefillAdder(
            self.tree,
            self.allocator,
            self.page_size,
            self.args.max_prefill_tokens,
            None if self.args.chunked_prefill_size == -1 else self.args.chunked_prefill_size,
            self.args.max_running_requests,
            self.req_pool.available_size(),
            reqs.pending_prefix_keys,
            self.host_tier,
        )
        if chunked is not None:
            adder.add_chunked_req(chunked)
        self._admit_waiting(adder)
        if chunked is not None and chunked not in adder.can_run:
            adder.new_chunked_req = chunked  # no room this time; it stays first in line
        reqs.chunked_req = adder.new_chunked_req
        batch = self._build_batch(adder.can_run) if adder.can_run else None
        tracer = get_tracer()
        if tracer.enabled:
            tracer.instant("queue", waiting=len(reqs.waiting) + len(reqs.bootstrap_queue))
        self.metrics.add_phase("build", t0, batch.seq if batch is not None else -1)
        if batch is not None:
            self.metrics.on_built(batch.seq)
        return batch

    def _admit_waiting(self, adder: PrefillAdder) -> None:
        waiting = self.reqs.waiting
        kept: list[Req] = []
        while waiting:
            req = waiting.popleft()
            verdict = adder.add_one_req(req)
            if verdict == AddResult.FULL:
                waiting.appendleft(req)
                break
            if verdict == AddResult.DEFER:
                kept.append(req)
        waiting.extendleft(reversed(kept))

    def _build_batch(self, reqs: list[Req]) -> ScheduleBatch:
        prefix_lens = [r.prefix_len for r in reqs]
        seq_lens = [r.seq_len for r in reqs]
        for r in reqs:
            self._ensure_row(r)
        out = self._alloc_extend(reqs, prefix_lens, seq_lens)
        kv_rows, input_ids, offset = [], [], 0
        for r, p, s in zip(reqs, prefix_lens, seq_lens):
            self.req_pool.write(r.req_pool_idx, p, out[offset : offset + s - p])
            offset += s - p
            kv_rows.append(self.req_pool.req_to_token[r.req_pool_idx, :s])
            input_ids.extend(r.fill_ids[p:s])
            r.status = ReqStatus.RUNNING
            if r.is_chunked:
                r.inflight_middle_chunks += 1
        fb = build_forward_batch(input_ids, prefix_lens, seq_lens, out, kv_rows)
        window = self.model_config.sliding_window if self.args.check_invariants else None
        add_swa_slots(self.allocator, fb, window)
        self.batch_seq += 1
        return ScheduleBatch(
            seq=self.batch_seq,
            reqs=reqs,
            forward=fb,
            fill_lens=seq_lens,
            sampling_info=SamplingBatchInfo.from_params(
                [r.sampling_params for r in reqs],
                self.model_config.vocab_size,
                # what a first token's repetition penalty covers: the whole prompt
                [r.origin_input_ids if r.is_last_chunk() else None for r in reqs],
            ),
            delay_sample=self.args.delay_sampling,
            return_logits=any(r.return_logits for r in reqs),
            new_tokens=len(input_ids),
        )

    def _ensure_row(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            return
        idx = self.req_pool.alloc()
        if idx is None:
            raise RuntimeError("no req_to_token row although the adder counted one")
        req.req_pool_idx = idx
        self.req_pool.write(idx, 0, req.prefix_indices)

    def _alloc_extend(self, reqs, prefix_lens, seq_lens) -> torch.Tensor:
        last = [int(r.prefix_indices[-1]) if p else -1 for r, p in zip(reqs, prefix_lens)]
        need = sum(self.allocator.pages_needed(p, s) for p, s in zip(prefix_lens, seq_lens))
        reclaim(self.tree, self.allocator, need)
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last)
        if out is None:
            raise RuntimeError("KV allocation failed although the adder reserved it")
        return out

    # ---- forward hand-off ----------------------------------------------------------------

    def snapshot_for_forward(self, batch: ScheduleBatch) -> ForwardSnapshot:
        t0 = clock_ns()
        snap = ForwardSnapshot.take(batch)
        self.metrics.add_phase("snapshot", t0, snap.seq)
        return snap

    def send_cached_prefixes(self, snap: ForwardSnapshot) -> None:
        """Early send, on the scheduler thread before the batch's submit, in every mode:
        KV already in the cache goes out before the suffix is computed.

        NOTE: a page of the prefix may still be written by a forward in flight (the
        chunked request's previous chunk); the transfer waits on the KV write fence first.
        """
        self.wait_host_loads(snap.seq)
        for req in snap.batch.reqs:
            if req.prefix_len > req.start_send_idx:
                t0 = clock_ns()
                self.send_kv_chunk(req, last=False, end_idx=req.prefix_len)
                self.metrics.add_phase("early-send", t0)

    def wait_host_loads(self, seq: int) -> None:
        """Host-store loads queued by admission fill their device pages before anything
        reads them (the early send, the forward)."""
        if self.host_tier is not None:
            t0 = clock_ns()
            self.host_tier.wait_loads()
            self.metrics.add_phase("host-load-wait", t0, seq)

    def submit(self, snap: ForwardSnapshot) -> None:
        """Hand the batch to the worker; send_cached_prefixes has run first and waited for
        the batch's host loads. With layer-wise send, the pages the forward completes go to
        the transfer now, to be read layer by layer as it writes them."""
        if self.host_tier is not None:
            self.host_tier.note_submit(snap.input)
        t0 = clock_ns()
        self.worker.submit(snap.input)
        self.forwards_in_flight += 1
        self.metrics.add_phase("submit", t0, snap.seq)
        if self.layerwise:
            t0 = clock_ns()
            self.send_by_layer(snap)
            self.metrics.add_phase("early-send", t0, snap.seq)

    def send_by_layer(self, snap: ForwardSnapshot) -> None:
        """Layer-wise send of forward `snap.seq`: each request's pages that this forward
        completes, the same pages its send after the forward would carry (whole pages up to
        a middle chunk's end; to the prompt's end in its last chunk), so that send and the
        last one carry no page. The last send still follows the forward: it carries the
        first token."""
        batch = snap.batch
        for req, end in zip(batch.reqs, batch.fill_lens):
            tail = req.is_last_chunk()
            self.send_kv_chunk(req, last=False, end_idx=end, whole_tail=tail, layer_seq=snap.seq)

    def collect(self, snap: ForwardSnapshot) -> ForwardResult:
        t0 = clock_ns()
        mailbox_before = self._mailbox_mark
        result = self.worker.collect(self.args.forward_timeout)
        self._mailbox_mark = self.worker.mailbox_bytes
        self.metrics.mailbox_bytes.append(self._mailbox_mark - mailbox_before)
        self.forwards_in_flight -= 1
        self.metrics.add_phase("collect", t0, snap.seq)
        self.metrics.on_forward(snap.input.forward, result)
        return result

    def run_batch(self, batch: ScheduleBatch) -> tuple[ForwardSnapshot, ForwardResult]:
        """Snapshot, early send, submit and collect at once (normal, overlap, thread, proc)."""
        snap = self.snapshot_for_forward(batch)
        self.send_cached_prefixes(snap)
        self.submit(snap)
        return snap, self.collect(snap)

    def sample_if_needed(self, snap: ForwardSnapshot, result: ForwardResult) -> ForwardResult:
        if result.next_token_ids is not None:
            return result
        t0 = clock_ns()
        result.wait_ready()
        self.metrics.add_phase("device-wait", t0, snap.seq)
        t0 = clock_ns()
        sampled = self.worker.sample(snap.input, self.args.forward_timeout)
        self.metrics.add_phase("sample", t0, snap.seq)
        return result._replace(next_token_ids=sampled.tokens, logprobs=sampled.logprobs)

    # ---- results and KV sends ------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: ForwardResult) -> None:
        t0 = clock_ns()
        result.wait_ready()
        self.metrics.add_phase("device-wait", t0, batch.seq)
        t0 = clock_ns()
        tokens = result.next_token_ids.tolist()
        logprobs = to_host(result.logprobs, [r.sampling_params for r in batch.reqs])
        reqs = self.reqs
        finished = []
        for i, req in enumerate(batch.reqs):
            reqs.release_prefix_key(req)
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1
                if req.finished:
                    reqs.release_aborted(req)
                else:
                    self.send_kv_chunk(req, last=False, end_idx=batch.fill_lens[i])
                continue
            if req.finished:  # aborted while its final chunk ran
                reqs.release_aborted(req)
                continue
            req.output_ids.append(tokens[i])
            if logprobs[i] is not None:
                req.output_logprobs.append(logprobs[i])
            if req.return_logits:
                req.logits = result.logits[i].float().clone()
            self.tree.cache_unfinished_req(req)
            finished.append(req)
            req.status = ReqStatus.TRANSFERRING
            self.metrics.on_transfer_start(req)
            reqs.inflight_queue.append(req)
            self.send_kv_chunk(req, last=True)
        if finished and self.host_tier is not None:
            self.host_tier.write_back(finished)
        self.metrics.add_phase("process", t0, batch.seq)

    def send_kv_chunk(
        self,
        req: Req,
        last: bool,
        end_idx: int | None = None,
        whole_tail: bool = False,
        layer_seq: int = 0,
    ) -> None:
        """Send KV [start_send_idx, end) of `req`; a non-final send stops on a page boundary
        unless `whole_tail` (the prompt's last page, sent layer-wise by its last chunk's
        forward). `layer_seq`: a layer-wise send of the pages forward `layer_seq` writes."""
        start = req.start_send_idx
        end = len(req.fill_ids) if end_idx is None else end_idx
        if not last and not whole_tail:
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
        logprob = req.first_logprob if last else None
        req.sender.send(page_indices, last, first, window, logprob, layer_seq)
