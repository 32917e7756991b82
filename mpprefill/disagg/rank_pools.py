"""The KV pools a prefill ships: one per tensor-parallel rank, each holding a range of the
model's KV heads (every head at TP 1), and which of them are read.

    TP 4, 2 KV heads    rank     0        1        2        3
                        heads    [0, 1)   [0, 1)   [1, 2)   [1, 2)
                        shipped  yes      -        yes      -

Ranks that share a KV head (fewer KV heads than ranks) hold equal copies of it, computed
from the same weights over the same tokens at the same slots, so the first rank of each
range ships it. The ranges shipped tile the model's heads; each bootstrap names them and
the prefill's TP size (wire.Bootstrap), and the decode side refuses a room whose ranges do
not tile its own pool's heads (wire.head_tiling_error).

A latent pool (multi-head latent attention, one tensor-parallel rank) keeps one row per
token and layer that every head shares: it ships as one pool of one "head", the row, and
its layout says latent (wire.PoolLayout.kv_layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from mpprefill.disagg.wire import PoolLayout, head_tiling_error
from mpprefill.memory.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class KVShard:
    kv: KVCache
    heads: range  # the model's KV heads its pool holds


@dataclass(frozen=True)
class ShippedKV:
    """The pools a prefill of `tp_size` ranks reads pages from: one per distinct head range,
    in head order."""

    tp_size: int
    shards: tuple[KVShard, ...]

    @classmethod
    def of(cls, kv: KVCache | Sequence[tuple[KVCache, range]]) -> ShippedKV:
        """From one pool (every head) or every rank's (pool, KV heads), rank 0 first
        (ProcessWorker.kv_shards)."""
        ranks = [(kv, range(kv.buffer.shape[3]))] if isinstance(kv, KVCache) else list(kv)
        if not ranks:
            raise ValueError("no KV pool to ship")
        distinct: dict[range, KVShard] = {}
        for pool, heads in ranks:
            # NOTE: a latent pool's row serves every head; the worker names the model's heads
            heads = range(1) if pool.latent else heads
            distinct.setdefault(heads, KVShard(pool, heads))
        shipped = cls(len(ranks), tuple(sorted(distinct.values(), key=lambda s: s.heads.start)))
        shipped._check()
        return shipped

    @property
    def num_kv_heads(self) -> int:
        return self.shards[-1].heads.stop

    @property
    def kv_heads(self) -> list[list[int]]:
        """Each shipped pool's heads as the bootstrap names them: [start, stop]."""
        return [[s.heads.start, s.heads.stop] for s in self.shards]

    def layout(self, page_size: int) -> PoolLayout:
        """The model's whole pool as these pools fill it: every KV head."""
        kv = self.shards[0].kv
        layout = PoolLayout.of(kv.buffer, page_size, kv.num_layers, kv.latent)
        return dataclasses.replace(layout, num_kv_heads=self.num_kv_heads)

    def _check(self) -> None:
        why = head_tiling_error(self.kv_heads, self.num_kv_heads, self.tp_size)
        if why:
            raise ValueError(f"KV shards: {why}")
        first = self.shards[0].kv
        for s in self.shards:
            if s.kv.buffer.shape[3] != len(s.heads):
                raise ValueError(
                    f"a KV pool of {s.kv.buffer.shape[3]} heads said to hold {s.heads}"
                )
            if _dims(s.kv) != _dims(first):
                raise ValueError(f"KV shards differ: {_dims(s.kv)} vs {_dims(first)}")


def _dims(kv: KVCache) -> tuple:
    """What every rank's pool has in common: all but its number of heads."""
    _, layers, slots, _, dim = kv.buffer.shape
    return (kv.dtype, kv.latent, layers, slots, dim, kv.swa_layers, kv.num_swa_slots)
