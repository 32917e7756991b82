"""Which planes of the prefill KV pools land where in the decode's dense pool, at which
heads, and which pages of the sliding-window layers are sent at all.

A plane is one (K or V, layer) of a pool, seen as [num_pages, page_size * heads * head_dim].
The prefill side has one pool, or two with sliding-window (SWA) layers (KVCache.buffer and
.swa_buffer); the decode pool is dense, every model layer in order (L of them):

    prefill pool   plane          decode plane
    full           c * F + j      c * L + full_layers[j]      c: 0 for K, 1 for V
    SWA            c * S + j      c * L + swa_layers[j]

A latent pool (multi-head latent attention) has one plane per layer, its rows: plane j is
layer j on both sides, a page page_size rows of kv_lora_rank + qk_rope_head_dim.

A tensor-parallel prefill has such pools per rank (rank_pools.py), each holding a range of the
model's KV heads; in every decode slot [H, D] its heads land at that range:

    decode page row   [page_size, H, D]      a pool of heads [a, b) writes [:, a:b, :]

SWA layers only ever send the pages of the prompt's last window (`window_first_page`); the
scheduler names their SWA pages (`window_swa_pages`) in the last send's `state_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mpprefill.memory.kv_cache import KVCache


def plane_view(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """[C, L, slots, H, D] -> [C * L, num_pages, page_size * H * D] (whole pages only); C: 2
    (K, V), or 1 (a latent pool's rows)."""
    c, layers, slots, heads, dim = buffer.shape
    pages = slots // page_size
    planes = buffer.view(c * layers, slots, heads * dim)[:, : pages * page_size]
    return planes.reshape(c * layers, pages, page_size * heads * dim)


@dataclass(frozen=True, slots=True)
class PoolPlanes:
    """One prefill pool as planes, each plane's index in the decode pool, and the model's
    KV heads the pool holds."""

    view: torch.Tensor  # [planes, num_pages, page_numel]
    dst_planes: torch.Tensor  # int64 [planes]
    heads: range
    head_dim: int
    num_layers: int  # layers of the pool: K's planes of each, then V's (latent: one each)

    @property
    def num_pages(self) -> int:
        return self.view.shape[1]

    @property
    def page_size(self) -> int:
        return self.view.shape[2] // (len(self.heads) * self.head_dim)

    def layer(self, j: int) -> PoolPlanes:
        """The planes of this pool's layer j alone (its K and V planes, or its latent rows'
        one): a strided view of the same memory, for a layer-wise send."""
        n = self.num_layers
        view = self.view[j::n]
        return PoolPlanes(view, self.dst_planes[j::n], self.heads, self.head_dim, 1)


def pool_planes(
    kv: KVCache, page_size: int, heads: range | None = None
) -> tuple[PoolPlanes, PoolPlanes | None]:
    """(full pool, SWA pool or None) of a prefill KVCache holding the model's KV `heads`
    (default: all of them)."""
    heads = range(kv.buffer.shape[3]) if heads is None else heads
    full = _planes(kv.buffer, kv.full_layers, kv.num_layers, page_size, heads)
    if kv.swa_buffer is None:
        return full, None
    return full, _planes(kv.swa_buffer, kv.swa_layers, kv.num_layers, page_size, heads)


def _planes(buffer: torch.Tensor, layers, num_layers: int, page_size: int, heads) -> PoolPlanes:
    ids = torch.tensor(layers, dtype=torch.int64)
    view = plane_view(buffer, page_size)
    dst = torch.cat([ids + c * num_layers for c in range(buffer.shape[0])])
    return PoolPlanes(view, dst, heads, buffer.shape[4], len(layers))


def head_rows(remote: torch.Tensor, planes: PoolPlanes) -> torch.Tensor:
    """The decode pool's planes [planes, pages, page_numel] as one row per (plane, page), cut
    to the heads of `planes`: [rows, page_numel] when it holds every head, else the strided
    [rows, page_size, its heads, head_dim] slice of [rows, page_size, H, D]."""
    rows = remote.view(-1, remote.shape[2])
    if rows.shape[1] == planes.view.shape[2]:
        return rows
    slots = rows.view(len(rows), planes.page_size, -1, planes.head_dim)
    return slots[:, :, planes.heads.start : planes.heads.stop]


def flat_index(planes: torch.Tensor, pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Rows of (plane, page) pairs, plane-major, in a [planes * num_pages, page_numel] view."""
    return (planes[:, None] * num_pages + pages[None, :]).flatten()


def window_first_page(prompt_len: int, window: int, page_size: int) -> int:
    """The first page (prompt order) of the last window [max(0, L - W + 1), L) of a prompt.

    NOTE: the decode's next query, at position L, sees keys L - W < j <= L, of which L is
    its own; the window sent is the rest, as whole pages, from this page to the prompt's
    last (none when W = 1).
    """
    first = max(0, prompt_len - window + 1)
    return first // page_size if first < prompt_len else -(-prompt_len // page_size)


def window_swa_pages(allocator, row: torch.Tensor, prompt_len: int, window: int) -> torch.Tensor:
    """The SWA-pool pages (SwaPagedAllocator) of a prompt's last window, prompt order, -1
    for a page without SWA KV: the `state_indices` of its last send. `row`: its
    req_to_token row.

    NOTE: read at the last send: the request's cache lock keeps its last window until
    its release, so every page here still has its SWA page.
    """
    ps = allocator.page_size
    lo = window_first_page(prompt_len, window, ps) * ps
    return allocator.translate(row[lo:prompt_len:ps], missing=-1) // ps
