"""Factories for both ends of a transfer backend: the prefill writer, the decode pool."""

from __future__ import annotations

import torch

from mpprefill.disagg.sender import FakeTransfer
from mpprefill.disagg.wire import PoolLayout
from mpprefill.memory.kv_cache import KVCache

BACKENDS = ("shm", "mooncake", "fake")
DECODE_BACKENDS = ("shm", "mooncake")


def make_transfer(
    name: str,
    kv: KVCache | list[tuple[KVCache, range]] | None,
    page_size: int,
    decode_address: str | None = None,
    **kw,
):
    """The prefill side's transfer backend. `kv`: the prefill's KV pool, or every tensor-
    parallel rank's with the KV heads it holds (Worker.kv_shards). `kw`: bootstrap_timeout,
    dead_timeout, bootstrap_host, bootstrap_port, ...

    "fake" moves nothing and needs no decode side; "shm" and "mooncake" start a
    transfer thread that talks to the decode receiver at `decode_address` (host:port), or,
    without one, serves the bootstrap endpoint where decode servers register their rooms.
    """
    if name == "fake":
        return FakeTransfer()
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; one of {BACKENDS}")
    if kv is None:
        raise ValueError(f"the {name} backend needs the prefill KV pool")
    if name == "shm":
        from mpprefill.disagg.shm_backend import ShmTransfer

        return ShmTransfer(kv, page_size, decode_address, **kw)
    from mpprefill.disagg.mooncake_backend import MooncakeTransfer

    return MooncakeTransfer(kv, page_size, decode_address, **kw)


def make_decode_pool(name: str, layout: PoolLayout, dtype: torch.dtype, host: str):
    """The decode receiver's pool for backend `name`: `.kv`, `.describe()`, `.close()`."""
    if name == "shm":
        from mpprefill.disagg.shm_backend import ShmPool

        return ShmPool(layout, dtype)
    if name == "mooncake":
        from mpprefill.disagg.mooncake_backend import MooncakePool

        return MooncakePool(layout, dtype, host)
    raise ValueError(f"the decode receiver supports {DECODE_BACKENDS}, not {name!r}")
