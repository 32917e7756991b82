"""KVCache: every layer's K and V for every token slot, in one contiguous tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mpprefill.model.config import ModelConfig

# NOTE: buffer layout [2, num_layers, num_slots, num_kv_heads, head_dim]; index 0 is K, 1 is V.
# One tensor so the whole pool can be one shared-memory segment. Slots are token-indexed;
# grouping slots into pages is the allocator's business, not this class's.


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
    ) -> None:
        shape = self.shape(num_layers, num_slots, num_kv_heads, head_dim)
        if buffer is None:
            buffer = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(buffer.shape) != shape or buffer.dtype != dtype:
            raise ValueError(
                f"KV buffer is {tuple(buffer.shape)} {buffer.dtype}, expected {shape} {dtype}"
            )
        elif not buffer.is_contiguous():
            raise ValueError("KV buffer must be contiguous")
        self.buffer = buffer

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        num_slots: int,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
    ) -> KVCache:
        layers, heads, dim = cls.model_dims(config)
        return cls(layers, num_slots, heads, dim, config.torch_dtype, device, buffer)

    @staticmethod
    def model_dims(config: ModelConfig) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of a model's KV."""
        return config.num_hidden_layers, config.num_key_value_heads, config.head_size

    @staticmethod
    def shape(
        num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int, int]:
        for n in (num_layers, num_slots, num_kv_heads, head_dim):
            if n <= 0:
                raise ValueError(f"KV cache dimensions must be positive, got {n}")
        return (2, num_layers, num_slots, num_kv_heads, head_dim)

    @property
    def num_layers(self) -> int:
        return self.buffer.shape[1]

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        _, layers, _, heads, dim = self.buffer.shape
        return 2 * layers * heads * dim * self.buffer.element_size()

    def k(self, layer: int) -> torch.Tensor:
        """View [num_slots, num_kv_heads, head_dim] of one layer's keys."""
        return self.buffer[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[1, layer]

    def write(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, num_kv_heads, head_dim] at slots locs [n]."""
        self.k(layer).index_copy_(0, locs, k.to(self.dtype))
        self.v(layer).index_copy_(0, locs, v.to(self.dtype))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Copy of the given slots for all layers, K and V: [2, num_layers, n, heads, dim]."""
        return self.buffer.index_select(2, slots)
