"""shm backend: the decode pool is a POSIX shared-memory segment the prefill side maps.

Decode side: `ShmPool` creates the segment and describes it by its tensor handle.
Prefill side: `ShmTransfer` opens the handle once and copies pages straight into it (each
tensor-parallel pool its KV heads of every slot), after `check_decode_segment`: the peer
names the segment, so only one that a decode receiver of this user made for its pool is
written (never the prefill's own KV pool or staging).
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat

import torch

import ipc
from ipc.handle import dtype_from_name
from ipc.shm import SHM_DIR
from mpprefill.disagg.plane_map import PoolPlanes, flat_index, head_rows, plane_view
from mpprefill.disagg.transfer import TransferBackend
from mpprefill.disagg.wire import PoolLayout, quote
from mpprefill.memory.kv_cache import KVCache

logger = logging.getLogger(__name__)

DECODE_SHM_TAG = "mppdecode"
# ipc.new_prefix(DECODE_SHM_TAG) + Segment.create: /mppdecode_<pid>_<hex>.<same pid>.<n>,
# or with the creator's PID namespace before <n>
_DECODE_SEGMENT = re.compile(rf"/{DECODE_SHM_TAG}_(\d+)_[0-9a-f]+\.(\d+)(\.\d+)?\.\d+")


# NOTE: copies go through [planes, num_pages, page_size * heads * head_dim] views (plane_map.py;
# a latent pool's: [layers, num_pages, page_size * row width]):
# index_select over dim 1 of that 3-D view, and index_copy_ over (plane, page) rows of the
# destination, run at memory speed, while the same gather over the page dim of a 6-D
# [2, L, pages, page, H, D] view is ~15x slower on CPU.
_STAGE_BYTES = 64 << 20  # largest gather staged at once; bigger sends go in parts


def kv_shape(layout: PoolLayout) -> tuple[int, int, int, int, int]:
    """The decode pool's buffer: [2, L, slots, H, D], or a latent pool's [1, L, slots, 1, D]."""
    dims = (layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
    return KVCache.shape(*dims, latent=layout.latent)


def check_decode_segment(handle: ipc.TensorHandle) -> None:
    """ValueError unless `handle` is a whole decode pool segment: named as `ShmPool` names
    its own, a regular file of this user, viewed from offset 0 and exactly its size."""
    m = _DECODE_SEGMENT.fullmatch(handle.name)
    if m is None or m[1] != m[2]:
        raise ValueError(f"segment {quote(handle.name)} is not a decode receiver's pool")
    itemsize = torch.empty((), dtype=dtype_from_name(handle.dtype)).element_size()
    nbytes = math.prod(handle.shape) * itemsize
    if handle.offset != 0 or handle.nbytes != nbytes:
        raise ValueError(f"decode pool handle at offset {handle.offset} of {handle.nbytes} bytes")
    try:
        st = os.lstat(os.path.join(SHM_DIR, handle.name.lstrip("/")))
    except OSError as e:
        raise ValueError(f"decode pool {handle.name}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ValueError(f"decode pool {handle.name} is not a segment of this user")
    if st.st_size != nbytes:
        raise ValueError(f"decode pool {handle.name} has {st.st_size} bytes, not {nbytes}")


def _gather(view: torch.Tensor, pages: torch.Tensor, out: torch.Tensor) -> None:
    """`out[p] = view[p, pages]` for every plane p. A layer's planes (a strided view, one
    plane in every L of the pool: PoolPlanes.layer) go one plane at a time: index_select
    over dim 1 of such a view took 11 ms for two planes of 256 pages here, against 10 us
    plane by plane."""
    if view.is_contiguous():
        torch.index_select(view, 1, pages, out=out)
        return
    for plane, rows in zip(view, out):
        torch.index_select(plane, 0, pages, out=rows)


class ShmPool:
    """The decode receiver's pool in a segment named after this process (swept if it dies)."""

    kind = "shm"

    def __init__(self, layout: PoolLayout, dtype: torch.dtype) -> None:
        ipc.sweep_stale(DECODE_SHM_TAG)
        self.layout = layout
        # populated: the prefill's transfer thread would otherwise allocate its pages
        self.shared = ipc.SharedTensor.create(
            kv_shape(layout), dtype, ipc.new_prefix(DECODE_SHM_TAG), populate=True
        )
        buffer = self.shared.tensor
        dims = kv_shape(layout)[1:]
        self.kv = KVCache(*dims, dtype=dtype, buffer=buffer, latent=layout.latent)
        logger.info("decode pool: %s (%d pages)", self.shared.handle.name, layout.num_pages)

    def describe(self) -> dict:
        handle = self.shared.handle.to_dict()
        return {"kind": self.kind, "layout": self.layout.to_dict(), "handle": handle}

    def close(self) -> None:
        self.shared.close()
        self.shared.unlink()


class ShmTransfer(TransferBackend):
    """Writes pages into the decode's segment: one gather and one scatter per pool and send."""

    name = "shm"

    def __init__(self, kv, page_size: int, decode_address: str | None = None, **kw):
        """`kv`: as TransferBackend takes it."""
        self._handle: ipc.TensorHandle | None = None
        self._remote: torch.Tensor | None = None  # decode pool, plane view
        self._stage: dict[torch.device, torch.Tensor] = {}  # per device of a prefill pool
        super().__init__(kv, page_size, decode_address, **kw)

    def _attach(self, pool: dict, address: str) -> tuple[PoolLayout, torch.Tensor]:
        if pool.get("kind") != self.name:
            raise ValueError(f"decode pool is {pool.get('kind')!r}, this backend writes shm")
        layout = PoolLayout.from_dict(pool.get("layout"))
        handle = ipc.TensorHandle.from_dict(pool.get("handle") or {})
        if self._handle is None or handle.key != self._handle.key:
            self._open(handle, layout)
        return layout, self._remote

    def _open(self, handle: ipc.TensorHandle, layout: PoolLayout) -> None:
        shape = kv_shape(layout)
        if layout.num_slots % layout.page_size:
            raise ValueError(f"decode pool of {layout.num_slots} slots is not whole pages")
        if handle.kind != "shm" or handle.shape != shape or handle.dtype != layout.dtype:
            raise ValueError(f"decode pool handle {handle.shape} {handle.dtype} != layout {shape}")
        check_decode_segment(handle)
        self._release()  # a restarted decode side has a new segment
        self._remote = plane_view(ipc.open_handle(handle), layout.page_size)
        self._handle = handle

    def _write(self, remote, src: torch.Tensor, dst: torch.Tensor, planes: PoolPlanes) -> None:
        view = planes.view  # [planes of this prefill pool, its pages, page_numel]
        n_planes, _, page_numel = view.shape
        # [decode planes * pages, page_numel], or [..., page_size, heads, D] of a TP shard
        rows = head_rows(remote, planes)
        step = max(1, _STAGE_BYTES // (n_planes * page_numel * view.element_size()))
        src = src.to(view.device)
        for i in range(0, len(src), step):
            staged = self._staging(view, len(src[i : i + step]))
            _gather(view, src[i : i + step], staged)
            at = flat_index(planes.dst_planes, dst[i : i + step], remote.shape[1])
            staged = staged.view(-1, *rows.shape[1:]).to(rows.device)
            rows.index_copy_(0, at.to(remote.device), staged)

    def _staging(self, view: torch.Tensor, num_pages: int) -> torch.Tensor:
        """A reused buffer: a fresh one per send would page-fault its whole size each time."""
        n_planes, _, page_numel = view.shape
        numel = n_planes * num_pages * page_numel
        stage = self._stage.get(view.device)
        if stage is None or stage.numel() < numel:
            stage = torch.empty(numel, dtype=view.dtype, device=view.device)
            self._stage[view.device] = stage
        return stage[:numel].view(n_planes, num_pages, page_numel)

    def _release(self) -> None:
        if self._handle is not None:
            ipc.close_handle(self._handle)
        self._handle = self._remote = None
