"""Entry point of the forward process: owns the device, the model and the KV pool."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

import torch

import ipc
from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig, load_model
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer
from mpprefill.worker.factory import set_torch_threads
from mpprefill.worker.messages import Done, Exit, Failed, Ready, Sample, Submit
from mpprefill.worker.runner import ForwardRunner
from mpprefill.worker.staging import read_slot

logger = logging.getLogger("mpprefill.worker")

FORWARD_DONE = 2  # index in the event table, after the per-slot "reads done" events
# Test hook: seconds between replying and signalling "reads done" (0: off).
SLOW_READS_S = float(os.environ.get("MPPREFILL_TEST_SLOW_READS", "0"))
VIOLATIONS: list[str] = []
LATE_READS: dict[int, threading.Thread] = {}


def worker_main(
    args_dict: dict,
    endpoint: str,
    parent: int,
    prefix: str,
    events: ipc.TensorHandle,
    max_reqs: int,
) -> None:
    logging.basicConfig(
        level=args_dict.get("log_level", "info").upper(),
        format="%(asctime)s %(levelname)s worker: %(message)s",
    )
    ipc.install_signal_cleanup()
    args = ServerArgs(**args_dict)
    set_torch_threads(args.worker_threads)
    if args.trace_dir:
        set_tracer(Tracer("worker", enabled=True))
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    code = 0
    try:
        runner, ready = _setup(args, prefix, max_reqs)
        ch.put(ready, timeout=60)
        _serve(
            ch, runner, ipc.open_bundle(ready.result), ipc.ShmEventTable(ipc.open_handle(events))
        )
    except ipc.PeerDied:
        logger.warning("scheduler went away; forward process exits")
        code = 1
    except BaseException as e:  # reported to the scheduler, then exit non-zero
        logger.exception("forward process failed")
        _report(ch, f"{type(e).__name__}: {e}")
        code = 1
    finally:
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            get_tracer().dump(args.trace_dir)
        ipc.unlink_owned()
        ch.close(linger_s=1.0)
    sys.exit(code)


def _setup(args: ServerArgs, prefix: str, max_reqs: int) -> tuple[ForwardRunner, Ready]:
    model = load_model(args.model_path, device=args.device, seed=args.random_seed)
    cfg: ModelConfig = model.config
    slots = args.num_pages * args.page_size
    shape = KVCache.shape(*_dims(cfg, slots))
    kv_shared = ipc.SharedTensor.create(shape, cfg.torch_dtype, prefix, args.device)
    kv = KVCache.for_model(cfg, slots, args.device, kv_shared.tensor)
    result = ipc.SharedBundle(
        {
            "tokens": ((max_reqs,), torch.int64),
            "logits": ((max_reqs, cfg.vocab_size), torch.float32),
        },
        prefix,
    )
    ready = Ready(os.getpid(), kv_shared.handle, result.handles, _config_dict(cfg))
    return ForwardRunner(model, kv), ready


def _dims(cfg: ModelConfig, slots: int) -> tuple[int, int, int, int]:
    layers, heads, dim = KVCache.model_dims(cfg)
    return layers, slots, heads, dim


def _config_dict(cfg: ModelConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)


def _serve(ch: ipc.Channel, runner: ForwardRunner, result: dict, events) -> None:
    last = None  # (logits, sampling) of the last forward, for deferred sampling
    while True:
        msg = ch.get()
        if isinstance(msg, Submit) and (late := LATE_READS.pop(msg.slot, None)) is not None:
            late.join()  # the earlier forward on this slot finishes reading first
        if VIOLATIONS:
            raise RuntimeError(VIOLATIONS[0])
        if isinstance(msg, Exit):
            return
        if isinstance(msg, Submit):
            last = _forward(ch, runner, result, events, msg)
        elif isinstance(msg, Sample):
            tokens = runner.sample(*last)
            result["tokens"][: len(tokens)].copy_(tokens)
            ch.put(Done(msg.seq, 0.0, True))
        else:
            raise RuntimeError(f"unexpected message {type(msg).__name__}")


def _forward(ch, runner: ForwardRunner, result: dict, events, msg: Submit):
    slot = ipc.open_bundle(msg.staging)
    fb, sampling = read_slot(slot, msg.num_tokens, msg.num_reqs, msg.num_kv, runner.kv.device)
    out = runner.forward(fb, sampling, msg.delay_sample, msg.seq)
    b = msg.num_reqs
    if out.next_token_ids is not None:
        result["tokens"][:b].copy_(out.next_token_ids)
    if msg.want_logits or msg.delay_sample:
        result["logits"][:b].copy_(out.logits)
    events[FORWARD_DONE].record(msg.seq)
    if SLOW_READS_S > 0:
        _late_reads_done(ch, fb, events, msg, out)
    else:
        events[msg.slot].record(msg.seq)  # shared reads done: the slot may be rewritten
        ch.put(Done(msg.seq, out.forward_s, out.next_token_ids is not None))
    if msg.delay_sample:
        return out.logits.clone(), _own_copy(sampling)
    return None


def _late_reads_done(ch, fb, events, msg: Submit, out) -> None:
    """Test mode: reply at once and signal "reads done" later from another thread, as an
    asynchronous device forward does; a rewrite of the slot meanwhile is a WAR violation."""
    before = fb.input_ids.clone(), fb.kv_indices.clone()

    def finish_reads() -> None:
        time.sleep(SLOW_READS_S)
        if not (torch.equal(before[0], fb.input_ids) and torch.equal(before[1], fb.kv_indices)):
            VIOLATIONS.append(
                f"staging slot {msg.slot} rewritten while forward {msg.seq} was still reading it"
            )
        events[msg.slot].record(msg.seq)

    t = threading.Thread(target=finish_reads, daemon=True)
    t.start()
    LATE_READS[msg.slot] = t
    ch.put(Done(msg.seq, out.forward_s, out.next_token_ids is not None))


def _own_copy(sampling):
    from mpprefill.sampling import SamplingBatchInfo

    return SamplingBatchInfo.from_tensors({k: v.clone() for k, v in sampling.to_tensors().items()})


def _report(ch: ipc.Channel, error: str) -> None:
    with contextlib.suppress(ipc.MailboxError):
        ch.put(Failed(error), timeout=1.0)
