"""Build the worker a forward mode asks for."""

from __future__ import annotations

from mpprefill.config import ServerArgs
from mpprefill.model import ModelConfig
from mpprefill.modes import ForwardMode
from mpprefill.worker.api import Worker
from mpprefill.worker.build import build_runner, scheduler_threads
from mpprefill.worker.hooks import DeviceHooks
from mpprefill.worker.local import InlineWorker, ThreadWorker
from mpprefill.worker.process import ProcessWorker
from mpprefill.worker.runner import set_torch_threads


def make_worker(args: ServerArgs, mode: ForwardMode) -> tuple[Worker, ModelConfig]:
    cfg = args.worker_config()
    if mode.in_process:
        set_torch_threads(scheduler_threads(cfg))
        worker = ProcessWorker(cfg)
        return worker, worker.model_config
    set_torch_threads(cfg.worker_threads)
    runner = build_runner(cfg, cfg.device.torch_device)
    DeviceHooks.from_env().guard(runner)
    if mode.inline:
        return InlineWorker(runner, cfg.publish_layers), runner.model.config
    return ThreadWorker(runner, args.page_size, cfg.publish_layers), runner.model.config
