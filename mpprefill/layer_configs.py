"""The small frozen configs each layer takes, built from `ServerArgs` at the edge: the
model loader, the KV pools, the host tier and the worker never see the whole server's
settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpprefill.devices import Device

SWA_PATTERN_HELP = (
    "which layers slide: 'all', layer ids '0,2,5', or a pattern of s (sliding) and f (full)"
    " repeated over the layers, e.g. 'sssf'"
)


@dataclass(frozen=True)
class ModelSource:
    """The model the loader builds: a checkpoint dir (None: the built-in model, its weights
    from `random_seed`), its dtype and the sliding-window overrides."""

    model_path: str | None = None
    dtype: str = "auto"
    sliding_window: int | None = None
    swa_layers: str | None = None
    random_seed: int = 0


@dataclass(frozen=True)
class PoolConfig:
    """The KV pools and the prefix cache over them."""

    page_size: int = 16
    max_total_tokens: int | None = None  # None: not sized yet (CUDA, from free memory)
    swa_full_tokens_ratio: float = 0.8
    chunked_prefill_size: int = 512
    disable_radix_cache: bool = False
    swa_free_out_of_window: bool = False

    @property
    def num_pages(self) -> int:
        if self.max_total_tokens is None:
            raise ValueError(
                "the KV pool is not sized: on CUDA give --max-total-tokens or size it from"
                " free memory first (mpprefill.commands.size_kv_pool)"
            )
        return self.max_total_tokens // self.page_size

    @property
    def num_swa_pages(self) -> int:
        """Pages of the SWA pool (used when the model has sliding-window layers)."""
        return max(1, int(self.num_pages * self.swa_full_tokens_ratio))

    @property
    def num_kv_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_swa_slots(self) -> int:
        return self.num_swa_pages * self.page_size


@dataclass(frozen=True)
class HostTierConfig:
    """The host KV store under the prefix cache (`size` tokens; 0: off)."""

    size: int
    page_size: int
    device: Device  # its host link times the copies on the emulated device
    batched_writeback: bool = True


@dataclass(frozen=True)
class LinkConfig:
    """The emulated network link the KV transfer takes (disagg/emulated_link.py): `gbps`
    of bandwidth, `latency_us` per message. `kv_bytes_per_token`: the bytes one token's KV
    of one layer puts on the wire, where they are not the pool's own (the emulated device's
    model is wider than its host stand-in); None: the bytes the pool holds."""

    gbps: float
    latency_us: float
    kv_bytes_per_token: int | None = None

    def __post_init__(self):
        if not (self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"--emulate-link-gbps must be a positive number, got {self.gbps}")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ValueError(f"--emulate-link-latency-us must be >= 0, got {self.latency_us}")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be positive, got {self.kv_bytes_per_token}")


@dataclass(frozen=True)  # NOTE: no slots: it crosses spawn by pickle, also on Python 3.10
class WorkerConfig:
    """What the forward worker (inline, thread or process group) is built from."""

    model: ModelSource
    pools: PoolConfig
    device: Device
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    staging: str = "pinned"
    tp_size: int = 1
    worker_threads: int = 0
    switch_interval_ms: float = 5.0
    forward_timeout: float = 300.0
    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    context_length: int | None = None
    mem_fraction_static: float = 0.85
    trace_dir: str | None = None
    disable_gc_freeze: bool = False
    log_level: str = "info"
    publish_layers: bool = False  # each forward publishes its per-layer KV completion

    @property
    def group_size(self) -> int:
        """Forward processes of the worker (`Device.group_size`)."""
        return self.device.group_size(self.tp_size)

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest prompt: --context-length, else the model's positions."""
        return self.context_length or max_position_embeddings
