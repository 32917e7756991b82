"""WritebackBuffers: reusable buffers that hold gathered KV until the host store's copy is done.

The copy thread gathers a copy's source slots into one buffer and scatters it into the
destination slots; the buffer goes back to the spares when the copy is done. Only that
thread takes and gives buffers.

NOTE: reuse matters on the host: a fresh allocation of tens of MiB is mapped anew and
page-faulted on first touch at every write; a spare is not.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_SPARES = 4


class WritebackBuffers:
    """Buffers for slots of a pool [planes, layers, slots, heads, dim]: 2 planes (K and V),
    or a latent pool's one."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        planes: int = 2,
    ):
        if planes not in (1, 2):
            raise ValueError(f"a KV pool has 1 plane (latent) or 2 (K and V), not {planes}")
        self.planes = planes
        self.dims = (num_layers, num_kv_heads, head_dim)
        self.slot_numel = planes * num_layers * num_kv_heads * head_dim
        self.dtype = dtype
        self._spares: list[Tensor] = []

    def take(self, num_slots: int, device: torch.device, pin: bool = False) -> Tensor:
        """A flat buffer for at least num_slots slots' KV: the smallest spare that fits, or a
        new one rounded up to a power of two of slots (pinned host memory with pin)."""
        need = num_slots * self.slot_numel
        fits = [i for i, b in enumerate(self._spares) if b.numel() >= need and b.device == device]
        if pin:
            fits = [i for i in fits if self._spares[i].is_pinned()]
        if fits:
            return self._spares.pop(min(fits, key=lambda i: self._spares[i].numel()))
        slots = 1 << max(num_slots - 1, 0).bit_length()
        return torch.empty(slots * self.slot_numel, dtype=self.dtype, device=device, pin_memory=pin)

    def view(self, buf: Tensor, num_slots: int) -> Tensor:
        """The first num_slots slots of buf as contiguous KV [planes, layers, n, heads, dim]."""
        layers, heads, dim = self.dims
        return buf[: num_slots * self.slot_numel].view(self.planes, layers, num_slots, heads, dim)

    def give(self, buf: Tensor) -> None:
        """Back to the spares; the smallest spare is dropped beyond MAX_SPARES."""
        self._spares.append(buf)
        if len(self._spares) > MAX_SPARES:
            sizes = [b.numel() for b in self._spares]
            self._spares.pop(sizes.index(min(sizes)))

    def spare_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._spares)
