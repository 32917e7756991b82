"""mooncake backend: pages move through the Mooncake transfer engine (TCP, P2P handshake).

Both pools are registered with an engine (the prefill's whole KVCache.storage: its full and
sliding-window pools; every shipped tensor-parallel pool's). The decode side describes its
pool by session id and base address; the prefill thread writes every (K/V, layer, run of
pages) chunk, addressed per plane (a latent pool: every (layer, run of pages) chunk of its
rows, one plane per layer), or, from a pool holding some of the KV heads, every
(K/V, layer, slot) chunk of those heads.
The peer names the session written to, so only a session on the host of the receiver that
named it, and never the prefill's own, is accepted (`check_session`).
"""

from __future__ import annotations

import logging
import socket

import torch

from mpprefill.disagg.plane_map import PoolPlanes
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.transfer import DEFAULT_DECODE_ADDRESS, TransferBackend
from mpprefill.disagg.wire import PoolLayout, quote
from mpprefill.memory.kv_cache import KVCache

logger = logging.getLogger(__name__)

# NOTE: measured here, one batch of more than about 2,100 entries fails (-1) and leaves the
# session unusable; a send is split into batches of at most this many entries.
MAX_BATCH_ENTRIES = 1024


class MooncakeUnavailable(RuntimeError):
    """The engine cannot be imported or initialised on this machine."""


def start_engine(host: str):
    """An initialised TransferEngine and its session id `host:rpc_port`."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # also missing libibverbs/librdmacm/libnuma
        raise MooncakeUnavailable(f"cannot import mooncake.engine: {e}") from e
    try:
        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    except Exception as e:
        raise MooncakeUnavailable(f"TransferEngine on {host!r} failed: {e}") from e
    if rc != 0:
        raise MooncakeUnavailable(f"TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) = {rc}")
    return engine, f"{host}:{engine.get_rpc_port()}"


def unavailable_reason(host: str = "127.0.0.1") -> str | None:
    """Why no engine starts on this machine (None when one does): starts one and drops it,
    since the package may import while the engine still lacks its OS libraries."""
    try:
        start_engine(host)
    except MooncakeUnavailable as e:
        return str(e)
    return None


def _register(engine, t: torch.Tensor) -> None:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("mooncake (non-CUDA build) needs a contiguous CPU KV buffer")
    rc = engine.register_memory(t.data_ptr(), t.numel() * t.element_size())
    if rc != 0:
        raise MooncakeUnavailable(f"register_memory failed ({rc})")


def check_session(session: str, decode_host: str, own_session: str) -> None:
    """ValueError unless `session` (host:port) is on `decode_host` (the receiver's that named
    it) and is not this prefill's own engine (whose registered memory is its KV pool)."""
    host, _, port = session.rpartition(":")
    if not port.isdigit() or session == own_session:
        raise ValueError(f"mooncake session {quote(session)} is not a decode receiver's")
    if _address(host) != _address(decode_host):
        raise ValueError(f"mooncake session {quote(session)} is not on {decode_host}")


def _host_of(address: str) -> str:
    """The host of `host:port` (a bare host as it is)."""
    host, sep, port = address.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else address


def _address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def local_host_for(remote_host: str) -> str:
    """This machine's address on the route to `remote_host` (no packet is sent)."""
    if remote_host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote_host, 9))
        return s.getsockname()[0]


class MooncakePool:
    """The decode receiver's pool: a plain CPU tensor registered with its own engine."""

    kind = "mooncake"

    def __init__(self, layout: PoolLayout, dtype: torch.dtype, host: str) -> None:
        self.layout = layout
        self.engine, self.session_id = start_engine(host)
        dims = (layout.num_layers, layout.num_slots, layout.num_kv_heads, layout.head_dim)
        self.kv = KVCache(*dims, dtype=dtype, latent=layout.latent)
        _register(self.engine, self.kv.buffer)
        logger.info("decode pool registered with mooncake session %s", self.session_id)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "layout": self.layout.to_dict(),
            "session_id": self.session_id,
            "base": self.kv.buffer.data_ptr(),
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.unregister_memory(self.kv.buffer.data_ptr())
            self.engine = None


class MooncakeTransfer(TransferBackend):
    """Writes with `batch_transfer_sync_write`: one batch per send (split past the cap)."""

    name = "mooncake"

    def __init__(
        self,
        kv,
        page_size: int,
        decode_address: str | None = None,
        local_host: str | None = None,
        **kw,
    ):
        """`kv`: as TransferBackend takes it. `local_host`: where this engine listens;
        default: this host's address on the route to `decode_address` (or to the bootstrap
        host, when rooms are registered)."""
        route_to = decode_address or kw.get("bootstrap_host") or DEFAULT_DECODE_ADDRESS
        host = local_host or local_host_for(_host_of(route_to))
        self._registered = [s.kv.storage for s in ShippedKV.of(kv).shards]
        self.engine, self.session_id = start_engine(host)
        for storage in self._registered:
            _register(self.engine, storage)
        super().__init__(kv, page_size, decode_address, **kw)

    def _attach(self, pool: dict, address: str) -> tuple[PoolLayout, tuple[str, int, PoolLayout]]:
        if pool.get("kind") != self.name:
            raise ValueError(f"decode pool is {pool.get('kind')!r}, this backend writes mooncake")
        layout = PoolLayout.from_dict(pool.get("layout"))
        session, base = pool.get("session_id"), pool.get("base")
        if not isinstance(session, str) or not isinstance(base, int) or base <= 0:
            raise ValueError(f"bad mooncake pool: session {quote(session)}, base {quote(base)}")
        check_session(session, _host_of(address), self.session_id)
        return layout, (session, base, layout)

    def _write(self, remote, src_pages: torch.Tensor, dst_pages: torch.Tensor, planes: PoolPlanes):
        session, dst_base, layout = remote
        src, dst, lens = self._chunks(src_pages, dst_pages, layout, dst_base, planes)
        for i in range(0, len(src), MAX_BATCH_ENTRIES):
            j = i + MAX_BATCH_ENTRIES
            rc = self.engine.batch_transfer_sync_write(session, src[i:j], dst[i:j], lens[i:j])
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write to {session} returned {rc}")

    def _chunks(self, src_pages, dst_pages, layout: PoolLayout, dst_base: int, planes: PoolPlanes):
        """(src addresses, dst addresses, lengths): one chunk per (K/V, layer, page run) of
        the prefill pool `planes`; per (K/V, layer, slot) from a pool of some of the heads."""
        if len(planes.heads) != layout.num_kv_heads:
            return self._head_chunks(src_pages, dst_pages, layout, dst_base, planes)
        view, es = planes.view, planes.view.element_size()
        page_bytes = view.shape[2] * es
        n = len(src_pages)
        brk = torch.ones(n, dtype=torch.bool)
        brk[1:] = (src_pages.diff() != 1) | (dst_pages.diff() != 1)
        starts = brk.nonzero().flatten()
        runs = torch.diff(starts, append=torch.tensor([n]))
        plane = torch.arange(view.shape[0], dtype=torch.int64)[:, None]
        src_at = view.data_ptr() + plane * view.stride(0) * es + src_pages[starts] * page_bytes
        dst_plane_bytes = layout.num_slots * (page_bytes // self.page_size)
        dst_plane = planes.dst_planes[:, None]
        dst_at = dst_base + dst_plane * dst_plane_bytes + dst_pages[starts] * page_bytes
        lens = (runs * page_bytes).expand_as(src_at)
        return src_at.flatten().tolist(), dst_at.flatten().tolist(), lens.flatten().tolist()

    def _head_chunks(self, src_pages, dst_pages, layout: PoolLayout, dst_base: int, planes):
        """The chunks of a pool holding KV heads [a, b) of H: in the decode pool a slot's
        heads a..b-1 are contiguous, the next slot's H heads further on.

            decode slot   | head 0 | ... | head a ... head b-1 | ... | head H-1 |
                                         ^ dst, (b - a) * D elements
        """
        view, es = planes.view, planes.view.element_size()
        ps = self.page_size
        src_slot = view.shape[2] // ps * es  # bytes of one slot's heads, both sides
        dst_slot = layout.num_kv_heads * layout.head_dim * es
        plane = torch.arange(view.shape[0], dtype=torch.int64)[:, None, None]
        slot = torch.arange(ps, dtype=torch.int64)[None, None, :]
        src_at = view.data_ptr() + plane * view.stride(0) * es
        src_at = src_at + (src_pages[None, :, None] * ps + slot) * src_slot
        dst_plane = planes.dst_planes[:, None, None] * layout.num_slots * dst_slot
        dst_at = dst_base + planes.heads.start * layout.head_dim * es + dst_plane
        dst_at = dst_at + (dst_pages[None, :, None] * ps + slot) * dst_slot
        n = src_at.numel()
        return src_at.flatten().tolist(), dst_at.flatten().tolist(), [src_slot] * n

    def _release(self) -> None:
        if self.engine is not None:
            for storage in self._registered:
                self.engine.unregister_memory(storage.data_ptr())
            self.engine = None
