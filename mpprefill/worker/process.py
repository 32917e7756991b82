"""ProcessWorker: the scheduler's side of the forward process."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator

import ipc
from ipc.events import EventAbandoned, EventTimeout
from mpprefill.layer_configs import WorkerConfig
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.model.loader import source_config
from mpprefill.model.parallel import TPRank, check_shardable, shard_config
from mpprefill.sampling.logprobs import Logprobs
from mpprefill.sampling.sampler import Sampled
from mpprefill.worker.api import ForwardInput, ForwardResult, Worker, WorkerDied, sleep_until_ns
from mpprefill.worker.build import kv_dtype
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import NUM_SLOTS, forward_gen, sample_gen
from mpprefill.worker.fence import KVWriteFence
from mpprefill.worker.forward_process import NUM_RESULT_SLOTS
from mpprefill.worker.group import (
    GroupOrder,
    GroupSentinel,
    RankLink,
    start_store,
    stop_process,
)
from mpprefill.worker.hooks import DeviceHooks
from mpprefill.worker.layers import LayerProgress
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.staging import make_staging, staging_specs

TAG = "mpp"
START_TIMEOUT = 300.0


class ProcessWorker(Worker):
    """Spawns the forward process (one per tensor-parallel rank: `group.py`); inputs travel
    through two shared staging slots, results through two result slots (forward N uses
    slot N % 2 of each)."""

    max_in_flight = 2

    def __init__(self, cfg: WorkerConfig, hooks: DeviceHooks | None = None):
        ipc.sweep_stale(TAG)
        self.cfg = cfg
        self.plan = DevicePlan.of(cfg.device.torch_device, cfg.staging)
        self.prefix = ipc.new_prefix(TAG)
        self._pending: deque[ForwardInput] = deque()
        self._kv: KVCache | None = None
        self._sentinel: GroupSentinel | None = None
        self._closed = False
        with contextlib.ExitStack() as undo:  # a start that fails leaves nothing behind
            undo.callback(ipc.remove_prefix, self.prefix)
            self._start(cfg, hooks or DeviceHooks.from_env(), undo)
            self._attach(self._await_ready(START_TIMEOUT))
            undo.pop_all()

    def _start(self, cfg: WorkerConfig, hooks: DeviceHooks, undo: contextlib.ExitStack):
        config = source_config(cfg.model)
        size = cfg.group_size
        if size > 1:
            check_shardable(config, size)
        self.staging = make_staging(_specs(cfg, config), self.prefix, self.plan)
        undo.callback(self.staging.unlink)
        self._store = start_store() if size > 1 else None
        store = None if self._store is None else ("127.0.0.1", self._store.port)
        self.ranks = [
            RankLink(cfg, self.plan, self.prefix, self.staging.handles, hooks, r, store, undo)
            for r in range(size)
        ]
        orders = [rank.order for rank in self.ranks]
        self.order = orders[0] if len(orders) == 1 else GroupOrder(orders)
        self.kv_fence = KVWriteFence(
            cfg.pools.num_pages,
            cfg.pools.page_size,
            self.order.kv_written,
            self.order.kv_written_query,
        )
        if len(self.ranks) > 1:
            self._sentinel = GroupSentinel([rank.proc for rank in self.ranks])
            undo.callback(self._sentinel.close)

    def _await_ready(self, timeout: float) -> list:
        """Every rank's first message (Ready unless it failed). Fails as soon as any rank
        fails or dies, while the others may still wait for it at the group's rendezvous."""
        if len(self.ranks) == 1:
            return [self._get(self.ranks[0], timeout)]
        deadline = time.monotonic() + timeout
        readies: dict[int, object] = {}
        while len(readies) < len(self.ranks):
            if time.monotonic() > deadline:
                raise WorkerDied(f"forward processes not ready within {timeout}s")
            for rank in self.ranks:
                if rank.rank not in readies and self._poll(rank, 0.05):
                    readies[rank.rank] = self._get(rank, 0)
        return [readies[rank.rank] for rank in self.ranks]

    def _poll(self, rank: RankLink, timeout: float) -> bool:
        """Whether a reply from `rank` is ready; raises once it died without one."""
        try:
            if rank.replies.poll(timeout):
                return True
        except ipc.PeerDied:
            raise WorkerDied(self._death(rank)) from None
        if rank.ended() and not rank.replies.poll(0):
            raise WorkerDied(self._death(rank))
        return False

    def _attach(self, readies: list) -> None:
        for rank, ready in zip(self.ranks, readies, strict=True):
            if not isinstance(ready, Ready):
                name = type(ready).__name__
                raise WorkerDied(f"{rank.label} sent {name} instead of Ready")
        self._readies = readies
        self._ready = readies[0]
        self.model_config = ModelConfig(**self._ready.model_config)
        if self.cfg.publish_layers:
            counters = [rank.order.events.layers_done for rank in self.ranks]
            self.layer_progress = LayerProgress(counters, self.model_config.num_hidden_layers)
        self.result = ipc.open_bundle(self._ready.result)  # rank 0 writes the results

    @property
    def kv_cache(self) -> KVCache:
        """The worker's pool, opened on first use (on a GPU this is the scheduler's first
        CUDA call with pinned staging). Read its pages only after `kv_fence`."""
        if len(self.ranks) > 1:
            raise ValueError("the KV pool is sharded over the tensor-parallel ranks")
        if self._kv is None:
            self._kv = self._pool(self.model_config, self._ready)
        return self._kv

    def kv_shards(self) -> list[tuple[KVCache, range]]:
        """Every rank's KV pool and the model's KV heads it holds, rank 0 first (one rank:
        the whole pool). Slot and page indices mean the same in every pool. Read pages
        only after `kv_fence`."""
        if len(self.ranks) == 1:
            return [(self.kv_cache, range(self.model_config.num_key_value_heads))]
        shards = []
        for r, ready in enumerate(self._readies):
            tp = TPRank(r, len(self.ranks))
            kv = self._pool(shard_config(self.model_config, tp), ready)
            shards.append((kv, tp.kv_heads(self.model_config)))
        return shards

    def _pool(self, config: ModelConfig, ready: Ready) -> KVCache:
        """A rank's KV pool (of `config`), over the segment its forward process shares; a
        segment of another dtype than this side resolves is refused."""
        return KVCache.for_model(
            config,
            self.cfg.pools.num_kv_slots,
            buffer=ipc.open_handle(ready.kv),
            num_swa_slots=self.cfg.pools.num_swa_slots,
            dtype=kv_dtype(self.cfg, config),
        )

    @property
    def pid(self) -> int:
        return self.ranks[0].proc.pid

    @property
    def sentinel(self) -> int:
        return self.ranks[0].proc.sentinel if self._sentinel is None else self._sentinel.fd

    def death(self) -> str | None:
        for rank in self.ranks:
            if rank.ended():
                return self._death(rank)
        return None

    def submit(self, inp: ForwardInput) -> None:
        self._check_room(self._pending)
        slot = inp.seq % NUM_SLOTS
        with self._events():
            counts = self.staging.write(slot, inp.seq, inp.forward, inp.sampling, self.order)
        self.kv_fence.note_writes(inp.seq, inp.forward.out_cache_loc)
        n_tok, n_req, n_kv = counts
        n_pen = len(inp.sampling.penalty_ids)
        msg = Submit(inp.seq, slot, n_tok, n_req, n_kv, inp.delay_sample, inp.return_logits, n_pen)
        for rank in self.ranks:
            self._put(rank, msg)
        self._pending.append(inp)

    def collect(self, timeout: float | None = None) -> ForwardResult:
        if not self._pending:
            raise RuntimeError("collect with nothing submitted")
        inp = self._pending[0]
        dones = [self._get(rank, timeout) for rank in self.ranks]
        for rank, done in zip(self.ranks, dones, strict=True):
            if done.seq != inp.seq:
                raise WorkerDied(f"{rank.label} answered {done.seq}, expected {inp.seq}")
        done = max(dones, key=lambda d: d.end_ns)  # the group is done when its last rank is
        sleep_until_ns(done.end_ns)  # the device's own finish time, where it knows it
        with self._events():
            self.order.before_result(forward_gen(done.seq), timeout)
        self._pending.popleft()
        self._note_collected(inp)
        b = inp.batch_size
        row = inp.seq % NUM_RESULT_SLOTS
        sampled = self._sampled(inp) if dones[0].sampled else None
        want = inp.return_logits or inp.delay_sample
        logits = self.result["logits"][row, :b].clone() if want else None
        return ForwardResult(
            done.seq,
            None if sampled is None else sampled.tokens,
            logits,
            done.forward_s,
            done.start_ns,
            done.end_ns,
            done.device_s,
            done.collective_s,
            None if sampled is None else sampled.logprobs,
        )

    def sample(self, inp: ForwardInput, timeout: float | None = None) -> Sampled:
        self._check_sample(inp, self._pending)
        for rank in self.ranks:
            self._put(rank, Sample(inp.seq))
        for rank in self.ranks:
            self._get(rank, timeout)
        with self._events():
            self.order.before_result(sample_gen(inp.seq), timeout)
        return self._sampled(inp)

    def _sampled(self, inp: ForwardInput) -> Sampled:
        """Forward `inp`'s tokens (and logprobs, where its rows ask) from its result slot."""
        row = inp.seq % NUM_RESULT_SLOTS
        b = inp.batch_size
        tokens = self.result["tokens"][row, :b].clone()
        if not inp.sampling.logprob_rows:
            return Sampled(tokens, None)
        k = inp.sampling.max_top_logprobs
        r = self.result
        lp = Logprobs(
            r["logprobs"][row, :b].clone(),
            r["top_ids"][row, :b, :k].clone(),
            r["top_logprobs"][row, :b, :k].clone(),
        )
        return Sampled(tokens, lp)

    @contextlib.contextmanager
    def _events(self) -> Iterator[None]:
        """Event waits fail as the worker's death does."""
        try:
            yield
        except EventAbandoned:
            raise WorkerDied(self.death() or "a forward process died") from None
        except EventTimeout as e:
            raise WorkerDied(f"forward process stalled: {e}") from None

    def _put(self, rank: RankLink, msg) -> None:
        try:
            rank.requests.put(msg, timeout=60)
        except ipc.PeerDied:
            raise WorkerDied(self._death(rank)) from None

    def _get(self, rank: RankLink, timeout: float | None):
        try:
            msg = rank.replies.get(timeout)
        except ipc.PeerDied:
            raise WorkerDied(self._death(rank)) from None
        except ipc.MailboxTimeout:
            raise WorkerDied(f"{rank.label} stalled: no reply within {timeout}s") from None
        if isinstance(msg, Failed):
            raise WorkerDied(f"{rank.label} failed: {msg.error}")
        if not isinstance(msg, Done | Ready):
            raise WorkerDied(f"unexpected message from the {rank.label}: {msg!r}")
        return msg

    def _death(self, rank: RankLink) -> str:
        report = None
        with contextlib.suppress(ipc.MailboxError):  # its last words, if it said any
            report = rank.replies.get(timeout=0)
        rank.proc.join(1)
        if isinstance(report, Failed):
            return f"{rank.label} failed: {report.error}"
        return f"{rank.label} died (exit code {rank.proc.exitcode})"

    @property
    def mailbox_bytes(self) -> int:
        channels = [ch for rank in self.ranks for ch in (rank.requests, rank.replies)]
        return sum(ch.bytes_sent + ch.bytes_recv for ch in channels)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            if rank.proc.is_alive():
                with contextlib.suppress(ipc.MailboxError):
                    rank.requests.put(Exit("close"), timeout=2)
        deadline = time.monotonic() + 5  # one wait for the whole group
        for rank in self.ranks:
            rank.proc.join(max(0.0, deadline - time.monotonic()))
            stop_process(rank.proc)
        if self._sentinel is not None:
            self._sentinel.close()
        self.staging.unlink()
        for rank in self.ranks:
            rank.events_st.unlink()
        ipc.remove_prefix(self.prefix)  # whatever the forward processes left behind
        for rank in self.ranks:
            rank.requests.close()
            rank.replies.close()
        self._store = None

    def kill_now(self) -> None:
        """Kill the forward processes, then unlink every segment and the channels' sockets."""
        with contextlib.suppress(Exception):
            for rank in self.ranks:
                stop_process(rank.proc, 1)
            self.close()
        for rank in self.ranks:
            for ch in (rank.requests, rank.replies):
                ipc.remove_ipc_endpoint(ch.endpoint)


def _specs(cfg: WorkerConfig, config: ModelConfig):
    """Room for any batch admission can build: at most max_running_requests requests, each
    at most the context length and the KV pool long (validated at admission); new tokens
    within the batch budgets, or one whole prompt when chunking is off."""
    longest = min(cfg.context_len(config.max_position_embeddings), cfg.pools.num_kv_slots)
    chunk = cfg.pools.chunked_prefill_size
    max_tokens = max(cfg.max_prefill_tokens, chunk, longest if chunk == -1 else 0)
    max_kv = cfg.max_running_requests * longest
    return staging_specs(max_tokens, cfg.max_running_requests, max_kv, config.has_sliding_layers)
