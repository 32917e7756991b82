"""The forward process: owns the device, the model and the KV pool; serves one message at
a time.

Per Submit, in stream order: wait "staged", read the slot, forward (recording "layers
done" after each layer: `layers.py`), record "reads done"
(after the copy-in when the slot was copied, else after the forward), "forward done",
write result slot seq % 2, record "result ready". Then flush (publish what a host-only
scheduler waits on) and reply. On a GPU (and on the emulated accelerator) the reply leaves
before the device finished; the scheduler reads results and KV only after their events.

Requests arrive and replies leave on threads of their own (`mailboxes.py`). Where the
slots are host memory that the forward reads in place (the CPU and the emulated device),
the receiving thread also waits "staged" and reads the slot, while the previous forward
still runs; on a GPU the forward stream does it, in order with the forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

import ipc
from mpprefill.emulation.device import EmulatedStream
from mpprefill.layer_configs import WorkerConfig
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig
from mpprefill.model.parallel import TPRank, init_tp_group, shard_config, tp_backend
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import Logprobs
from mpprefill.sampling.params import MAX_TOP_LOGPROBS
from mpprefill.streams import HostStream
from mpprefill.trace.gc import GcWatch, freeze_heap
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer
from mpprefill.worker import profile_control
from mpprefill.worker.api import ForwardInput
from mpprefill.worker.build import (
    build_runner,
    forward_threads,
    kv_dtype,
    worker_model_config,
)
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import WorkerOrder, forward_gen, make_events, sample_gen
from mpprefill.worker.hooks import DeviceHooks, LateReads
from mpprefill.worker.layers import LayerPublisher
from mpprefill.worker.mailboxes import Inbox, Outbox
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.runner import ForwardRunner, set_torch_threads
from mpprefill.worker.staging import pin_segments, read_slot

logger = logging.getLogger("mpprefill.worker")
NUM_RESULT_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What the scheduler hands the forward process at spawn (pickled once, by spawn).

    NOTE: handles travel as plain dicts: frozen slots dataclasses do not unpickle on 3.10.
    """

    config: WorkerConfig
    plan: DevicePlan
    prefix: str
    events: dict  # handle of the int64 generation table
    cuda_events: dict[str, str] | None  # CUDA IPC event handles by name (cuda-ipc only)
    slots: list[dict[str, dict]]  # handles of both staging slots' fields
    max_reqs: int
    hooks: DeviceHooks
    tp_rank: int = 0  # this process's tensor-parallel rank (of config.tp_size)
    tp_store: tuple[str, int] | None = None  # the group's rendezvous (tp_size > 1)

    @classmethod
    def of(
        cls, config: WorkerConfig, plan, prefix, events, cuda_events, slots, max_reqs, hooks, **tp
    ):
        slot_dicts = [{k: h.to_dict() for k, h in s.items()} for s in slots]
        events = events.to_dict()
        return cls(config, plan, prefix, events, cuda_events, slot_dicts, max_reqs, hooks, **tp)

    def slot_handles(self) -> list[dict[str, ipc.TensorHandle]]:
        return [{k: ipc.TensorHandle.from_dict(d) for k, d in s.items()} for s in self.slots]


def result_specs(max_reqs: int, vocab_size: int) -> ipc.bundle.Specs:
    """Both result slots: row seq % 2 holds forward seq's tokens and logits, and the
    tokens' logprobs (`sampling.logprobs.Logprobs`, K = MAX_TOP_LOGPROBS at most)."""
    slots = NUM_RESULT_SLOTS
    return {
        "tokens": ((slots, max_reqs), torch.int64),
        "logits": ((slots, max_reqs, vocab_size), torch.float32),
        "logprobs": ((slots, max_reqs), torch.float32),
        "top_ids": ((slots, max_reqs, MAX_TOP_LOGPROBS), torch.int64),
        "top_logprobs": ((slots, max_reqs, MAX_TOP_LOGPROBS), torch.float32),
    }


@dataclasses.dataclass
class WorkerLoop:
    runner: ForwardRunner
    slots: list[dict[str, torch.Tensor]]  # both staging slots, opened once
    result: dict[str, torch.Tensor] | None  # both result slots (host shared memory); None
    # on tensor-parallel ranks other than 0, whose results nobody reads
    order: WorkerOrder
    stream: HostStream
    layers: LayerPublisher | None  # each layer's completion (layer-wise send), or None
    late_reads: LateReads | None = None
    read_ahead: bool = False  # the receiving thread reads host slots (see the module doc)
    last: tuple | None = None  # (seq, logits, sampling) of a deferred forward, for its Sample

    def prepare(self, msg):
        """On the receiving thread, as each request arrives."""
        if self.read_ahead and isinstance(msg, Submit):
            return self._read(msg)
        return None

    def serve(self, inbox: Inbox, outbox: Outbox) -> None:
        tracer = get_tracer()
        while True:
            with tracer.span("recv"):
                msg, read = self._next(inbox)
            if isinstance(msg, Exit):
                self.stream.drain()
                return
            t0 = time.perf_counter()
            if isinstance(msg, Submit):
                if self.late_reads is not None:
                    self.late_reads.before_reuse(msg.slot)
                span = self.stream.run(partial(self._forward, msg, read))
                sampled = not msg.delay_sample
            elif isinstance(msg, Sample):
                span = self.stream.run(partial(self._sample, msg))
                sampled = True
            else:
                raise RuntimeError(f"unexpected message {type(msg).__name__}")
            self.order.flush()
            self.stream.check()
            span = span or (0, 0, 0.0, 0.0)
            outbox.put(Done(msg.seq, time.perf_counter() - t0, sampled, *span))

    def _next(self, inbox: Inbox):
        if not self.stream.runs_elsewhere:
            return inbox.get()
        while True:  # the device may fail while the scheduler waits on its events
            self.stream.check()
            try:
                return inbox.get(timeout=0.05)
            except queue.Empty:
                continue

    def _read(self, msg: Submit):
        with get_tracer().span("read", msg.seq):
            self.order.before_read(msg.slot, msg.seq)
            return read_slot(
                self.slots[msg.slot],
                msg.num_tokens,
                msg.num_reqs,
                msg.num_kv,
                self.runner.kv.device,
                msg.num_penalty_ids,
            )

    def _forward(self, msg: Submit, read=None) -> tuple[int, int, float, float]:
        o = self.order
        slot = msg.slot
        seq = msg.seq
        fb, sampling, copied = read or self._read(msg)
        if copied:
            o.reads_done(slot, seq)
        inp = ForwardInput(seq, fb, sampling, msg.delay_sample, msg.want_logits)
        out = self.runner.forward(inp, None if self.layers is None else self.layers.hook(seq))
        self.last = (seq, out.logits.clone(), _own_copy(sampling)) if msg.delay_sample else None
        if not copied:
            self._release(slot, seq, fb)
        with get_tracer().span("result", seq):
            o.forward_done(seq)
            want_logits = msg.want_logits or msg.delay_sample
            logits = out.logits if want_logits else None
            self._write_result(seq, out.next_token_ids, logits, out.logprobs)
            o.result_ready(forward_gen(seq))
        return out.start_ns, out.end_ns, out.device_s, out.collective_s

    def _sample(self, msg: Sample) -> None:
        """Samples the forward before it, which must be `msg.seq` and deferred."""
        last, self.last = self.last, None
        if last is None or last[0] != msg.seq:
            had = "none" if last is None else last[0]
            raise RuntimeError(f"Sample {msg.seq}, but the deferred forward before it is {had}")
        sampled = self.runner.sample(last[1], last[2])
        self._write_result(msg.seq, sampled.tokens, None, sampled.logprobs)
        self.order.result_ready(sample_gen(msg.seq))

    def _release(self, slot: int, seq: int, fb: ForwardBatch) -> None:
        record = partial(self.order.reads_done, slot, seq)
        if self.late_reads is None:
            record()
        else:
            self.late_reads.release(slot, seq, fb, record)

    def _write_result(
        self,
        seq: int,
        tokens: torch.Tensor | None,
        logits: torch.Tensor | None,
        logprobs: Logprobs | None = None,
    ):
        if self.result is None:
            return
        row = seq % NUM_RESULT_SLOTS
        out = self.result
        if tokens is not None:
            out["tokens"][row, : len(tokens)].copy_(tokens, non_blocking=True)
        if logits is not None:
            out["logits"][row, : len(logits)].copy_(logits, non_blocking=True)
        if logprobs is not None:
            b, k = logprobs.top_ids.shape
            out["logprobs"][row, :b].copy_(logprobs.token, non_blocking=True)
            out["top_ids"][row, :b, :k].copy_(logprobs.top_ids, non_blocking=True)
            out["top_logprobs"][row, :b, :k].copy_(logprobs.top, non_blocking=True)


def _own_copy(sampling: SamplingBatchInfo) -> SamplingBatchInfo:
    """Sampling rows that outlive the slot they were read from."""
    return dataclasses.replace(sampling, **{k: v.clone() for k, v in sampling.to_tensors().items()})


def worker_main(setup: WorkerSetup, endpoints: tuple[str, str], parent: int) -> None:
    """`endpoints`: the scheduler's request channel and its reply channel."""
    _start_process(setup, parent)
    cfg = setup.config
    requests = ipc.Channel(endpoints[0], bind=False, peer_pid=parent, peer_is_parent=True)
    replies = ipc.Channel(endpoints[1], bind=False, peer_pid=parent, peer_is_parent=True)
    watch = GcWatch().install()  # its pauses show as spans in a trace
    outbox = None
    code = 0
    try:
        loop, ready, _owned = _setup(cfg, setup, parent)
        if not cfg.disable_gc_freeze:
            freeze_heap()
        replies.put(ready, timeout=60)
        outbox = Outbox(replies)
        loop.serve(Inbox(requests, loop.prepare), outbox)
    except ipc.PeerDied:
        logger.warning("scheduler went away; forward process exits")
        code = 1
    except BaseException as e:  # reported to the scheduler, then exit non-zero
        logger.exception("forward process failed")
        code = 1
        if outbox is not None:
            outbox.close()
            outbox = None
        _report(replies, f"{type(e).__name__}: {e}")
    finally:
        if outbox is not None:
            outbox.close()
        watch.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
        if cfg.trace_dir:
            os.makedirs(cfg.trace_dir, exist_ok=True)
            get_tracer().dump(cfg.trace_dir)
        ipc.unlink_owned()
        replies.close(linger_s=1.0)
        requests.close()
    sys.exit(code)


def _start_process(setup: WorkerSetup, parent: int) -> None:
    """Logging, signals, the tie to the scheduler's life, threads, tracing and the profile
    control socket: what the process needs before it builds anything."""
    name = "worker" if setup.tp_store is None else f"worker{setup.tp_rank}"
    logging.basicConfig(
        level=setup.config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {name}: %(message)s",
    )
    # NOTE: Ctrl-C reaches the whole process group; the scheduler owns shutdown and stops
    # this process itself, so SIGINT is ignored here. SIGTERM still cleans up and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ipc.install_signal_cleanup((signal.SIGTERM,))
    # The scheduler's death (even by SIGKILL, mid-forward) sends SIGTERM: the segments this
    # process owns go with it. Its pid is never polled: another process may get it.
    if not ipc.die_with_parent(parent, signal.SIGTERM):
        logger.warning("scheduler went away before the forward process started")
        sys.exit(1)
    cfg = setup.config
    set_torch_threads(forward_threads(cfg))
    sys.setswitchinterval(cfg.switch_interval_ms / 1e3)  # as in the scheduler's process
    if cfg.trace_dir:
        set_tracer(Tracer("worker", enabled=True))
    profile_control.serve_control()  # /start_profile and /stop_profile reach this process there


def _setup(settings: WorkerConfig, setup: WorkerSetup, parent: int):
    """The loop, the Ready message, and the shared buffers this process owns."""
    plan = setup.plan
    tp = _join_group(settings, setup, plan)
    runner, kv_shared = _runner(settings, plan, setup.prefix, tp)
    setup.hooks.guard(runner)
    cfg: ModelConfig = runner.model.config
    result, views = None, None
    if setup.tp_rank == 0:
        result = ipc.SharedBundle(result_specs(setup.max_reqs, cfg.vocab_size), setup.prefix)
        views = ipc.open_bundle(result.handles)  # NOTE: the mapping that gets page-locked
    slot_handles = setup.slot_handles()
    slots = [ipc.open_bundle(h) for h in slot_handles]
    pinned = []
    if plan.pin_host_buffers:
        results = [] if result is None else list(result.handles.values())
        shared = [*results, *(h for s in slot_handles for h in s.values())]
        pinned = pin_segments(shared)
    table = ipc.open_handle(ipc.TensorHandle.from_dict(setup.events))
    events, _ = make_events(plan, "worker", table, setup.cuda_events)
    stream = _stream(runner, plan, setup.hooks)
    order = WorkerOrder(events, alive=lambda: ipc.parent_alive(parent), record=stream.record)
    late = setup.hooks.late_reads(plan)
    read_ahead = plan.device == "cpu"  # host slots, read in place
    layers = order.layers(stream, len(runner.model.layers)) if settings.publish_layers else None
    loop = WorkerLoop(runner, slots, views, order, stream, layers, late, read_ahead)
    handles = {} if result is None else result.handles
    ready = Ready(os.getpid(), kv_shared.handle, handles, dataclasses.asdict(cfg))
    return loop, ready, (kv_shared, result, pinned)


def _join_group(settings: WorkerConfig, setup: WorkerSetup, plan: DevicePlan) -> TPRank | None:
    """This rank's place in its tensor-parallel group (on a GPU, device `rank`)."""
    if setup.tp_store is None:
        return None
    if plan.device == "cuda":
        torch.cuda.set_device(setup.tp_rank)
    backend = tp_backend(plan.device)
    return init_tp_group(
        setup.tp_rank, settings.tp_size, setup.tp_store, backend, settings.forward_timeout
    )


def _runner(settings: WorkerConfig, plan: DevicePlan, prefix: str, tp: TPRank | None = None):
    """The runner, its KV pool (this rank's KV heads) in a shared segment this process owns."""
    cfg = worker_model_config(settings)
    kv_cfg = cfg if tp is None else shard_config(cfg, tp)
    pools = settings.pools
    shape = KVCache.model_storage_shape(kv_cfg, pools.num_kv_slots, pools.num_swa_slots)
    # NOTE: populated, as torch.zeros touches an in-process pool: first-touch faults would
    # otherwise land in the forwards (18% of uncached ITPS at 0.5B/8,192 emulated)
    dtype = kv_dtype(settings, kv_cfg)
    kv_shared = ipc.SharedTensor.create(shape, dtype, prefix, plan.device, populate=True)
    return build_runner(settings, plan.device, kv_shared.tensor, cfg, tp), kv_shared


def _stream(runner: ForwardRunner, plan: DevicePlan, hooks: DeviceHooks) -> HostStream:
    if runner.device is not None:  # the emulated accelerator keeps its own clock
        return EmulatedStream(runner.device.clock)
    return hooks.stream(plan)


def _report(ch: ipc.Channel, error: str) -> None:
    with contextlib.suppress(ipc.MailboxError):
        ch.put(Failed(error), timeout=1.0)
