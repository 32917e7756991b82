"""KVCache: every layer's K and V for every token slot; sliding-window layers in a pool
of their own; or, for latent attention, one latent row per token and layer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch


class ModelConfig(Protocol):
    """What the pool reads of a model's config (the model's ModelConfig has it): the pool
    sits below the model, which writes into it."""

    num_hidden_layers: int
    num_key_value_heads: int

    @property
    def head_size(self) -> int: ...

    @property
    def torch_dtype(self) -> torch.dtype: ...

    @property
    def kv_latent_dim(self) -> int:
        """Width of a token's latent row per layer; 0: K and V per KV head."""
        ...

    def is_sliding(self, layer: int) -> bool: ...


# NOTE: buffer layout [2, num_layers, num_slots, num_kv_heads, head_dim]; index 0 is K, 1 is V.
# One tensor so the whole pool can be one shared-memory segment. Slots are token-indexed;
# grouping slots into pages is the allocator's business, not this class's.
#
# With sliding-window (SWA) layers the one storage tensor holds two pools back to back:
#
#   storage = | buffer     [2, full layers, num_slots,     heads, dim] |
#             | swa_buffer [2, SWA layers,  num_swa_slots, heads, dim] |
#
# A model layer's slots index its own pool: SWA layers take SWA-pool slots (the
# allocator's `translate`), every other layer the full pool's.
#
# A latent pool (`latent=True`, multi-head latent attention) holds one plane, no V:
#
#   storage = buffer [1, num_layers, num_slots, 1, latent dim]
#
# a token's row per layer being what every head's K and V are decompressed from (the
# latent and the rope key, `ModelConfig.kv_latent_dim`). The KV transfer ships it as one
# plane per layer, and the decode side keeps one of the same layout (`model_dims`).


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
        *,
        swa_layers: Sequence[int] = (),
        num_swa_slots: int = 0,
        latent: bool = False,
    ) -> None:
        if latent and (num_kv_heads != 1 or swa_layers):
            raise ValueError("a latent KV pool holds one row per token: one head, no SWA pool")
        self.latent = latent
        self.swa_layers = tuple(sorted(set(swa_layers)))
        self.full_layers = tuple(i for i in range(num_layers) if i not in self.swa_layers)
        if any(not 0 <= i < num_layers for i in self.swa_layers):
            raise ValueError(f"SWA layers {self.swa_layers} out of range for {num_layers}")
        if self.swa_layers and num_swa_slots <= 0:
            raise ValueError(f"SWA layers need a positive SWA pool, got {num_swa_slots} slots")
        shape = self.storage_shape(
            num_layers, num_slots, num_kv_heads, head_dim, self.swa_layers, num_swa_slots, latent
        )
        if buffer is None:
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(buffer.shape) != shape or buffer.dtype != dtype:
            raise ValueError(
                f"KV buffer is {tuple(buffer.shape)} {buffer.dtype}, expected {shape} {dtype}"
            )
        elif not buffer.is_contiguous():
            raise ValueError("KV buffer must be contiguous")
        self.storage = buffer
        self.num_layers = num_layers
        if not self.swa_layers:
            self.buffer, self.swa_buffer = buffer, None
        else:
            full = (2, len(self.full_layers), num_slots, num_kv_heads, head_dim)
            n_full = math.prod(full)
            self.buffer = buffer[:n_full].view(full)
            swa = (2, len(self.swa_layers), num_swa_slots, num_kv_heads, head_dim)
            self.swa_buffer = buffer[n_full:].view(swa)
        self._where = {i: (self.buffer, j) for j, i in enumerate(self.full_layers)}
        self._where.update({i: (self.swa_buffer, j) for j, i in enumerate(self.swa_layers)})

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_slots: int,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
        num_swa_slots: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """The pool of a model; SWA layers get `num_swa_slots` (default: num_slots). `dtype`:
        the pool's (--kv-cache-dtype, resolved), which may differ from the model's; None:
        the model's. A latent-attention model gets a latent pool."""
        layers, heads, dim, swa, n_swa = cls._model_layout(config, num_slots, num_swa_slots)
        return cls(
            layers,
            num_slots,
            heads,
            dim,
            config.torch_dtype if dtype is None else dtype,
            device,
            buffer,
            swa_layers=swa,
            num_swa_slots=n_swa,
            latent=config.kv_latent_dim > 0,
        )

    @classmethod
    def _model_layout(cls, config: ModelConfig, num_slots: int, num_swa_slots: int | None):
        """(layers, heads, head_dim, SWA layers, SWA pool slots) of a model's pool; a latent
        pool's: one head of the latent row's width (a latent model has no SWA layers)."""
        swa = cls.swa_layers_of(config)
        n_swa = (num_slots if num_swa_slots is None else num_swa_slots) if swa else 0
        return (*cls.model_dims(config), swa, n_swa)

    @staticmethod
    def model_dims(config: ModelConfig) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of a model's K and V, as the decode side and
        the KV transfer lay them out; a latent-attention model's (num_layers, 1, latent row
        width), its pool being `latent`."""
        if config.kv_latent_dim:
            return config.num_hidden_layers, 1, config.kv_latent_dim
        return config.num_hidden_layers, config.num_key_value_heads, config.head_size

    @staticmethod
    def swa_layers_of(config: ModelConfig) -> tuple[int, ...]:
        return tuple(i for i in range(config.num_hidden_layers) if config.is_sliding(i))

    @classmethod
    def model_storage_shape(
        cls, config: ModelConfig, num_slots: int, num_swa_slots: int | None = None
    ) -> tuple[int, ...]:
        """Shape of the storage tensor `for_model` takes (to allocate it elsewhere)."""
        layers, heads, dim, swa, n_swa = cls._model_layout(config, num_slots, num_swa_slots)
        latent = config.kv_latent_dim > 0
        return cls.storage_shape(layers, num_slots, heads, dim, swa, n_swa, latent)

    @staticmethod
    def shape(
        num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, latent: bool = False
    ) -> tuple[int, int, int, int, int]:
        """[2 (K, V), layers, slots, heads, dim]; a latent pool's [1, layers, slots, 1, dim]."""
        for n in (num_layers, num_slots, num_kv_heads, head_dim):
            if n <= 0:
                raise ValueError(f"KV cache dimensions must be positive, got {n}")
        return (1 if latent else 2, num_layers, num_slots, num_kv_heads, head_dim)

    @classmethod
    def storage_shape(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        swa_layers: Sequence[int] = (),
        num_swa_slots: int = 0,
        latent: bool = False,
    ) -> tuple[int, ...]:
        """The 5-D buffer shape without SWA layers; one flat length with them."""
        full = cls.shape(num_layers, num_slots, num_kv_heads, head_dim, latent)
        if not swa_layers:
            return full
        n_swa = len(swa_layers)
        swa = cls.shape(n_swa, num_swa_slots, num_kv_heads, head_dim)
        return (math.prod(full) // num_layers * (num_layers - n_swa) + math.prod(swa),)

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[2]

    @property
    def num_swa_slots(self) -> int:
        return 0 if self.swa_buffer is None else self.swa_buffer.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token occupies across all full-attention layers, K and V (or its
        latent rows)."""
        planes, layers, _, heads, dim = self.buffer.shape
        return planes * layers * heads * dim * self.buffer.element_size()

    def k(self, layer: int) -> torch.Tensor:
        """View [slots of its pool, num_kv_heads, head_dim] of one layer's keys."""
        pool, j = self._where[layer]
        return pool[0, j]

    def v(self, layer: int) -> torch.Tensor:
        if self.latent:
            raise ValueError("a latent KV pool holds no V: read its rows with `latent_rows`")
        pool, j = self._where[layer]
        return pool[1, j]

    def latent_rows(self, layer: int) -> torch.Tensor:
        """View [slots, latent dim] of one layer's latent rows (a latent pool's)."""
        if not self.latent:
            raise ValueError("this KV pool holds K and V, not latent rows")
        return self.buffer[0, layer, :, 0]

    def write_latent(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [n, latent dim] at slots locs [n] of a latent pool's layer."""
        self.latent_rows(layer).index_copy_(0, locs, rows.to(self.dtype))

    def write(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, num_kv_heads, head_dim] at slots locs [n] of the layer's pool."""
        self.k(layer).index_copy_(0, locs, k.to(self.dtype))
        self.v(layer).index_copy_(0, locs, v.to(self.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Copy of the given slots for all layers, K and V: [2, num_layers, n, heads, dim]
        ([1, num_layers, n, 1, dim] of a latent pool)."""
        if self.swa_buffer is not None:
            raise ValueError("gather reads one pool; this cache has an SWA pool too")
        return self.buffer.index_select(2, slots)
