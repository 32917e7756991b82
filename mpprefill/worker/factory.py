"""Build the worker a forward mode asks for."""

from __future__ import annotations

import os

import torch

from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.worker.base import Worker
from mpprefill.worker.runner import ForwardRunner


def set_torch_threads(n: int) -> None:
    torch.set_num_threads(n if n > 0 else max(1, os.cpu_count() or 1))


def swa_slots(args: ServerArgs) -> int:
    """Slots of the SWA pool (for models with sliding-window layers)."""
    return args.num_swa_pages * args.page_size


def build_runner(args: ServerArgs, kv_buffer: torch.Tensor | None = None) -> ForwardRunner:
    """Model and KV pool on args.device; the KV pool may live in a given (shared) buffer."""
    model = args.load_model()
    kv = KVCache.for_model(
        model.config, args.num_pages * args.page_size, args.device, kv_buffer, swa_slots(args)
    )
    return ForwardRunner(model, kv)


def make_worker(args: ServerArgs, mode: str) -> tuple[Worker, ModelConfig]:
    if mode in ("proc", "proc-ahead"):
        from mpprefill.worker.process import ProcessWorker

        worker = ProcessWorker(args)
        return worker, worker.model_config
    from mpprefill.worker.local import InlineWorker, ThreadWorker

    set_torch_threads(args.worker_threads)
    runner = build_runner(args)
    if mode in ("normal", "overlap"):
        return InlineWorker(runner), runner.model.config
    return ThreadWorker(runner, args.page_size), runner.model.config
