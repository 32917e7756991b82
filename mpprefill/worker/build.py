"""Model, KV pool and runner for the worker's side, from its config (`WorkerConfig`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence

import torch

from mpprefill.config import kv_pool_tokens
from mpprefill.emulation.device import host_config, host_model
from mpprefill.emulation.setup import clock_for
from mpprefill.layer_configs import WorkerConfig
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ModelConfig
from mpprefill.model.config import resolve_dtypes
from mpprefill.model.families import build_model
from mpprefill.model.loader import source_config, source_model
from mpprefill.model.parallel import TPRank, shard_config
from mpprefill.worker.device import device_memory
from mpprefill.worker.runner import ForwardRunner

logger = logging.getLogger(__name__)
_PER_TOKEN_PROBE = 1 << 20  # tokens of the pool whose bytes give the bytes per token


def pool_tokens(
    cfg: WorkerConfig, memory: Callable[[Sequence[str]], tuple[int, int]] = device_memory
) -> int:
    """Tokens of the KV pool on CUDA: what --mem-fraction-static leaves of the devices'
    free memory once one rank's weights are counted. `memory(devices)`: (free, total)
    bytes of the tightest."""
    free, total = memory(rank_devices(cfg))
    config = worker_model_config(cfg)
    tp = TPRank(0, cfg.tp_size) if cfg.tp_size > 1 else None
    weights, per_token = weight_bytes(config, tp), kv_bytes_per_token(cfg, config, tp)
    frac = cfg.mem_fraction_static
    tokens = kv_pool_tokens(free, total, weights, per_token, frac, cfg.pools.page_size)
    logger.info(
        "KV pool: %d tokens (%.2f GiB) from --mem-fraction-static %.2f of %.2f GiB (%.2f GiB"
        " free, weights %.2f GiB)",
        tokens,
        tokens * per_token / 2**30,
        frac,
        total / 2**30,
        free / 2**30,
        weights / 2**30,
    )
    return tokens


def rank_devices(cfg: WorkerConfig) -> list[str]:
    """The CUDA devices the forward processes use: rank r on cuda:r in a group."""
    if cfg.tp_size > 1:
        return [f"cuda:{r}" for r in range(cfg.tp_size)]
    return [cfg.device.torch_device]


def weight_bytes(config: ModelConfig, tp: TPRank | None = None) -> int:
    """Bytes of the model's weights (one rank's shard with `tp`), counted on the meta
    device: no memory, no checkpoint read."""
    model = build_model(config, device="meta", tp=tp)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(cfg: WorkerConfig, config: ModelConfig, tp: TPRank | None = None) -> int:
    """Bytes of the KV pool per token of --max-total-tokens (one rank's KV heads with
    `tp`), the SWA pool's share included for sliding-window models."""
    kv_cfg = config if tp is None else shard_config(config, tp)
    probe = dataclasses.replace(cfg.pools, max_total_tokens=_PER_TOKEN_PROBE)
    shape = KVCache.model_storage_shape(kv_cfg, probe.num_kv_slots, probe.num_swa_slots)
    itemsize = kv_dtype(cfg, kv_cfg).itemsize
    return math.ceil(math.prod(shape) * itemsize / _PER_TOKEN_PROBE)


def forward_threads(cfg: WorkerConfig) -> int:
    """Torch threads of one forward process: `--worker-threads`, else every core, or a
    CPU rank of a group its share of them."""
    if cfg.worker_threads > 0:
        return cfg.worker_threads
    return max(1, (os.cpu_count() or 1) // cfg.group_size)


def scheduler_threads(cfg: WorkerConfig) -> int:
    """Torch threads of the scheduler process while forward processes run: the cores they
    leave, at least one. Its tensor work is small (staging writes, page gathers), and a
    thread pool that spans a core a forward process keeps busy makes each parallel op
    wait for a thread that is not running (a slot write of 60k indices took 2-8 ms
    instead of 0.1)."""
    return max(1, (os.cpu_count() or 1) - cfg.group_size * forward_threads(cfg))


def kv_dtype(cfg: WorkerConfig, config: ModelConfig) -> torch.dtype:
    """The KV pool's dtype: --kv-cache-dtype, auto: the model's (`config`: the worker's,
    `worker_model_config(cfg)`, or a rank's shard of it). Every process that makes or
    opens the pool asks here."""
    return resolve_dtypes(cfg.model.dtype, cfg.kv_cache_dtype, config.dtype).kv_torch


def worker_model_config(cfg: WorkerConfig) -> ModelConfig:
    """The config of the model the worker runs, in its served dtype (for an emulated
    device, the small-width stand-in with the emulated model's layer count, in the dtype
    --dtype resolves to for --model-path)."""
    emulation = cfg.device.emulation
    if emulation is not None:
        return host_config(source_config(cfg.model), emulation.model)
    return source_config(cfg.model)


def worker_model(
    cfg: WorkerConfig, config: ModelConfig, device: str, tp: TPRank | None = None
) -> CausalLM:
    """The model of `worker_model_config(cfg)` (`config`), on `device`; with `tp`, this
    rank's shard of it."""
    if cfg.device.emulated:
        return host_model(config, cfg.model.random_seed)
    return source_model(cfg.model, device, tp)


def build_runner(
    cfg: WorkerConfig,
    device: str,
    kv_buffer: torch.Tensor | None = None,
    config: ModelConfig | None = None,
    tp: TPRank | None = None,
) -> ForwardRunner:
    """Model and KV pool on `device`; the KV pool may live in a given (shared) buffer.
    `config`: `worker_model_config(cfg)` where the caller has it already. With `tp`, the
    rank's shard of the model and its KV heads' pool."""
    model = worker_model(cfg, config or worker_model_config(cfg), device, tp)
    model.set_attention_backend(cfg.attention_backend)
    kv_cfg = model.kv_config
    dtype = kv_dtype(cfg, kv_cfg)
    pools = cfg.pools
    kv = KVCache.for_model(
        kv_cfg, pools.num_kv_slots, device, kv_buffer, pools.num_swa_slots, dtype
    )
    return ForwardRunner(model, kv, clock_for(cfg.device))
