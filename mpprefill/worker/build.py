"""Model, KV pool and runner for the worker's side, from the server's args."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence

import torch

from mpprefill.config import ServerArgs, kv_pool_tokens
from mpprefill.emulation.device import host_config, host_model
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ModelConfig
from mpprefill.model.config import resolve_dtypes
from mpprefill.model.families import build_model
from mpprefill.model.loader import config_from_args, model_from_args
from mpprefill.model.parallel import TPRank, shard_config
from mpprefill.worker.device import device_memory
from mpprefill.worker.runner import ForwardRunner

logger = logging.getLogger(__name__)
_PER_TOKEN_PROBE = 1 << 20  # tokens of the pool whose bytes give the bytes per token


def swa_slots(args: ServerArgs) -> int:
    """Slots of the SWA pool (for models with sliding-window layers)."""
    return args.num_swa_pages * args.page_size


def num_kv_slots(args: ServerArgs) -> int:
    return args.num_pages * args.page_size


def size_kv_pool(
    args: ServerArgs, memory: Callable[[Sequence[str]], tuple[int, int]] = device_memory
) -> ServerArgs:
    """`args` with its KV pool sized: --max-total-tokens as given (or the CPU's default),
    else, on CUDA, what --mem-fraction-static leaves of the devices' free memory once one
    rank's weights are counted. `memory(devices)`: (free, total) bytes of the tightest."""
    if args.max_total_tokens is not None:
        return args
    free, total = memory(rank_devices(args))
    config = worker_model_config(args)
    tp = TPRank(0, args.tp_size) if args.tp_size > 1 else None
    weights, per_token = weight_bytes(config, tp), kv_bytes_per_token(args, config, tp)
    frac = args.mem_fraction_static
    tokens = kv_pool_tokens(free, total, weights, per_token, frac, args.page_size)
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
    return args.replace(max_total_tokens=tokens)


def rank_devices(args: ServerArgs) -> list[str]:
    """The CUDA devices the forward processes use: rank r on cuda:r in a group."""
    if args.tp_size > 1:
        return [f"cuda:{r}" for r in range(args.tp_size)]
    return [args.worker_device.torch_device]


def weight_bytes(config: ModelConfig, tp: TPRank | None = None) -> int:
    """Bytes of the model's weights (one rank's shard with `tp`), counted on the meta
    device: no memory, no checkpoint read."""
    model = build_model(config, device="meta", tp=tp)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(args: ServerArgs, config: ModelConfig, tp: TPRank | None = None) -> int:
    """Bytes of the KV pool per token of --max-total-tokens (one rank's KV heads with
    `tp`), the SWA pool's share included for sliding-window models."""
    kv_cfg = config if tp is None else shard_config(config, tp)
    probe = args.replace(max_total_tokens=_PER_TOKEN_PROBE)
    shape = KVCache.model_storage_shape(kv_cfg, num_kv_slots(probe), swa_slots(probe))
    itemsize = kv_dtype(args, kv_cfg).itemsize
    return math.ceil(math.prod(shape) * itemsize / _PER_TOKEN_PROBE)


def group_size(args: ServerArgs) -> int:
    """Forward processes of the worker (`Device.group_size`)."""
    return args.worker_device.group_size(args.tp_size)


def forward_threads(args: ServerArgs) -> int:
    """Torch threads of one forward process: `--worker-threads`, else every core, or a
    CPU rank of a group its share of them."""
    if args.worker_threads > 0:
        return args.worker_threads
    return max(1, (os.cpu_count() or 1) // group_size(args))


def scheduler_threads(args: ServerArgs) -> int:
    """Torch threads of the scheduler process while forward processes run: the cores they
    leave, at least one. Its tensor work is small (staging writes, page gathers), and a
    thread pool that spans a core a forward process keeps busy makes each parallel op
    wait for a thread that is not running (a slot write of 60k indices took 2-8 ms
    instead of 0.1)."""
    return max(1, (os.cpu_count() or 1) - group_size(args) * forward_threads(args))


def kv_dtype(args: ServerArgs, config: ModelConfig) -> torch.dtype:
    """The KV pool's dtype: --kv-cache-dtype, auto: the model's (`config`: the worker's,
    `worker_model_config(args)`, or a rank's shard of it). Every process that makes or
    opens the pool asks here."""
    return resolve_dtypes(args.dtype, args.kv_cache_dtype, config.dtype).kv_torch


def worker_model_config(args: ServerArgs) -> ModelConfig:
    """The config of the model the worker runs, in its served dtype (for an emulated
    device, the small-width stand-in with the emulated model's layer count, in the dtype
    --dtype resolves to for --model-path)."""
    emulation = args.worker_device.emulation
    if emulation is not None:
        return host_config(config_from_args(args), emulation.model)
    return config_from_args(args)


def worker_model(
    args: ServerArgs, config: ModelConfig, device: str, tp: TPRank | None = None
) -> CausalLM:
    """The model of `worker_model_config(args)` (`config`), on `device`; with `tp`, this
    rank's shard of it."""
    if args.worker_device.emulated:
        return host_model(config, args.random_seed)
    return model_from_args(args, device, tp)


def build_runner(
    args: ServerArgs,
    device: str,
    kv_buffer: torch.Tensor | None = None,
    config: ModelConfig | None = None,
    tp: TPRank | None = None,
) -> ForwardRunner:
    """Model and KV pool on `device`; the KV pool may live in a given (shared) buffer.
    `config`: `worker_model_config(args)` where the caller has it already. With `tp`, the
    rank's shard of the model and its KV heads' pool."""
    model = worker_model(args, config or worker_model_config(args), device, tp)
    model.set_attention_backend(args.attention_backend)
    cfg = model.kv_config
    dtype = kv_dtype(args, cfg)
    kv = KVCache.for_model(cfg, num_kv_slots(args), device, kv_buffer, swa_slots(args), dtype)
    return ForwardRunner(model, kv, args.worker_device.clock())
