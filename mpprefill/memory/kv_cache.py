"""KVCache: every layer's K and V for every token slot; sliding-window layers in a pool
of their own."""

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
    ) -> None:
        self.swa_layers = tuple(sorted(set(swa_layers)))
        self.full_layers = tuple(i for i in range(num_layers) if i not in self.swa_layers)
        if any(not 0 <= i < num_layers for i in self.swa_layers):
            raise ValueError(f"SWA layers {self.swa_layers} out of range for {num_layers}")
        if self.swa_layers and num_swa_slots <= 0:
            raise ValueError(f"SWA layers need a positive SWA pool, got {num_swa_slots} slots")
        shape = self.storage_shape(
            num_layers, num_slots, num_kv_heads, head_dim, self.swa_layers, num_swa_slots
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
        the model's."""
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
        )

    @classmethod
    def _model_layout(cls, config: ModelConfig, num_slots: int, num_swa_slots: int | None):
        """(layers, heads, head_dim, SWA layers, SWA pool slots) of a model's pool."""
        swa = cls.swa_layers_of(config)
        n_swa = (num_slots if num_swa_slots is None else num_swa_slots) if swa else 0
        return (*cls.model_dims(config), swa, n_swa)

    @staticmethod
    def model_dims(config: ModelConfig) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of a model's KV."""
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
        return cls.storage_shape(layers, num_slots, heads, dim, swa, n_swa)

    @staticmethod
    def shape(
        num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int, int]:
        for n in (num_layers, num_slots, num_kv_heads, head_dim):
            if n <= 0:
                raise ValueError(f"KV cache dimensions must be positive, got {n}")
        return (2, num_layers, num_slots, num_kv_heads, head_dim)

    @classmethod
    def storage_shape(
        cls,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        swa_layers: Sequence[int] = (),
        num_swa_slots: int = 0,
    ) -> tuple[int, ...]:
        """The 5-D buffer shape without SWA layers; one flat length with them."""
        full = cls.shape(num_layers, num_slots, num_kv_heads, head_dim)
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
        """Bytes one token occupies across all full-attention layers, K and V."""
        _, layers, _, heads, dim = self.buffer.shape
        return 2 * layers * heads * dim * self.buffer.element_size()

    def k(self, layer: int) -> torch.Tensor:
        """View [slots of its pool, num_kv_heads, head_dim] of one layer's keys."""
        pool, j = self._where[layer]
        return pool[0, j]

    def v(self, layer: int) -> torch.Tensor:
        pool, j = self._where[layer]
        return pool[1, j]

    def write(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, num_kv_heads, head_dim] at slots locs [n] of the layer's pool."""
        self.k(layer).index_copy_(0, locs, k.to(self.dtype))
        self.v(layer).index_copy_(0, locs, v.to(self.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Copy of the given slots for all layers, K and V: [2, num_layers, n, heads, dim]."""
        if self.swa_buffer is not None:
            raise ValueError("gather reads one pool; this cache has an SWA pool too")
        return self.buffer.index_select(2, slots)
