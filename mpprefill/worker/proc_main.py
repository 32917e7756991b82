"""Entry point of the forward process: owns the device, the model and the KV pool."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys

import torch

import ipc
from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer
from mpprefill.worker.device import DevicePlan, make_stream
from mpprefill.worker.emulation import late_reads
from mpprefill.worker.factory import set_torch_threads, swa_slots
from mpprefill.worker.messages import Failed, Ready
from mpprefill.worker.ordering import WorkerOrder, make_events
from mpprefill.worker.proc_loop import WorkerLoop
from mpprefill.worker.runner import ForwardRunner

logger = logging.getLogger("mpprefill.worker")


@dataclasses.dataclass(frozen=True)
class WorkerSetup:
    """What the scheduler hands the forward process at spawn (pickled once, by spawn).

    NOTE: handles travel as plain dicts: frozen slots dataclasses do not unpickle on 3.10.
    """

    args: dict
    plan: DevicePlan
    prefix: str
    events: dict  # handle of the int64 generation table
    cuda_events: dict[str, str] | None  # CUDA IPC event handles by name (cuda-ipc only)
    slots: list[dict[str, dict]]  # handles of both staging slots' fields
    max_reqs: int

    @classmethod
    def of(cls, args: dict, plan: DevicePlan, prefix: str, events, cuda_events, slots, max_reqs):
        slot_dicts = [{k: h.to_dict() for k, h in s.items()} for s in slots]
        return cls(args, plan, prefix, events.to_dict(), cuda_events, slot_dicts, max_reqs)

    def slot_handles(self) -> list[dict[str, ipc.TensorHandle]]:
        return [{k: ipc.TensorHandle.from_dict(d) for k, d in s.items()} for s in self.slots]


def worker_main(setup: WorkerSetup, endpoint: str, parent: int) -> None:
    logging.basicConfig(
        level=setup.args.get("log_level", "info").upper(),
        format="%(asctime)s %(levelname)s worker: %(message)s",
    )
    # NOTE: Ctrl-C reaches the whole process group; the scheduler owns shutdown and stops
    # this process itself, so SIGINT is ignored here. SIGTERM still cleans up and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ipc.install_signal_cleanup((signal.SIGTERM,))
    args = ServerArgs(**setup.args)
    set_torch_threads(args.worker_threads)
    if args.trace_dir:
        set_tracer(Tracer("worker", enabled=True))
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    code = 0
    try:
        loop, ready, _owned = _setup(args, setup, ch, parent)
        ch.put(ready, timeout=60)
        loop.serve()
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


def _setup(args: ServerArgs, setup: WorkerSetup, ch: ipc.Channel, parent: int):
    """The loop, the Ready message, and the shared buffers this process owns."""
    plan = setup.plan
    model = args.load_model(plan.device)
    cfg: ModelConfig = model.config
    num_slots, n_swa = args.num_pages * args.page_size, swa_slots(args)
    shape = KVCache.model_storage_shape(cfg, num_slots, n_swa)
    kv_shared = ipc.SharedTensor.create(shape, cfg.torch_dtype, setup.prefix, plan.device)
    kv = KVCache.for_model(cfg, num_slots, plan.device, kv_shared.tensor, n_swa)
    result = ipc.SharedBundle(_result_specs(setup.max_reqs, cfg.vocab_size), setup.prefix)
    views = ipc.open_bundle(result.handles)  # NOTE: the mapping that gets page-locked
    slot_handles = setup.slot_handles()
    slots = [ipc.open_bundle(h) for h in slot_handles]
    pinned = _pin(plan, [*result.handles.values(), *(h for s in slot_handles for h in s.values())])
    table = ipc.open_handle(ipc.TensorHandle.from_dict(setup.events))
    events, _ = make_events(plan, "worker", table, setup.cuda_events)
    order = WorkerOrder(events, alive=lambda: ipc.pid_alive(parent))
    runner = ForwardRunner(model, kv)
    loop = WorkerLoop(ch, runner, slots, views, order, make_stream(plan), late_reads(plan.device))
    ready = Ready(os.getpid(), kv_shared.handle, result.handles, dataclasses.asdict(cfg))
    return loop, ready, (kv_shared, result, pinned)


def _result_specs(max_reqs: int, vocab_size: int) -> ipc.bundle.Specs:
    return {
        "tokens": ((max_reqs,), torch.int64),
        "logits": ((max_reqs, vocab_size), torch.float32),
    }


def _pin(plan: DevicePlan, handles: list[ipc.TensorHandle]) -> list[torch.Tensor]:
    if not plan.pin_host_buffers:
        return []
    from mpprefill.worker.staging_cuda import pin_segments

    return pin_segments(handles)


def _report(ch: ipc.Channel, error: str) -> None:
    with contextlib.suppress(ipc.MailboxError):
        ch.put(Failed(error), timeout=1.0)
