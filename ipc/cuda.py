"""CUDA IPC: export a CUDA tensor as a handle, open it once per process, and events.

A CUDA IPC memory handle covers the whole block of the caching allocator, so the
consumer rebuilds the tensor from the block's base plus the storage offset; torch's
own rebuild does that, and also keeps the producer's block alive (a shared
reference counter) until every consumer has released it. A handle can be opened
only once per process, hence the cache.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ipc.handle import TensorHandle, b64, dtype_from_name, dtype_name, unb64

_open_cache: dict[tuple, torch.Tensor] = {}
_cache_lock = threading.Lock()


def export_cuda(t: torch.Tensor) -> TensorHandle:
    """A handle for a contiguous CUDA tensor. The caller keeps `t` alive meanwhile."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda or not t.is_contiguous():
        raise ValueError("export_cuda needs a contiguous CUDA tensor")
    _, args = reduce_tensor(t)
    (
        _cls,
        size,
        stride,
        offset,
        _scls,
        dtype,
        device,
        handle,
        storage_size,
        storage_offset,
        _rg,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    extra = {
        "device": int(device),
        "stride": list(stride),
        "storage_offset_elems": int(offset),
        "storage_size": int(storage_size),
        "storage_offset_bytes": int(storage_offset),
        "ref_handle": b64(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": b64(event_handle) if event_handle else "",
        "event_sync": bool(event_sync),
    }
    return TensorHandle(
        kind="cuda",
        name=b64(handle),
        dtype=dtype_name(dtype),
        shape=tuple(size),
        offset=int(storage_offset),
        nbytes=int(storage_size),
        extra=extra,
    )


def open_cuda(h: TensorHandle) -> torch.Tensor:
    """The tensor behind `h`; each handle is opened once per process and cached."""
    with _cache_lock:
        t = _open_cache.get(h.key)
        if t is None:
            t = _rebuild(h)
            _open_cache[h.key] = t
        return t


def _rebuild(h: TensorHandle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    x: dict[str, Any] = h.extra
    return rebuild_cuda_tensor(
        torch.Tensor,
        h.shape,
        tuple(x["stride"]),
        x["storage_offset_elems"],
        torch.storage.UntypedStorage,
        dtype_from_name(h.dtype),
        x["device"],
        unb64(h.name),
        x["storage_size"],
        x["storage_offset_bytes"],
        False,
        unb64(x["ref_handle"]),
        x["ref_offset"],
        unb64(x["event_handle"]) if x["event_handle"] else None,
        x["event_sync"],
    )


def release_cuda(h: TensorHandle) -> None:
    """Drop this process's reference so the producer may free the block."""
    with _cache_lock:
        _open_cache.pop(h.key, None)


class CudaIpcEvent:
    """An interprocess CUDA event; the generation argument exists for API parity."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    @classmethod
    def create(cls) -> CudaIpcEvent:
        return cls(torch.cuda.Event(interprocess=True, blocking=True))

    @classmethod
    def from_handle(cls, device: int, handle: str) -> CudaIpcEvent:
        return cls(torch.cuda.Event.from_ipc_handle(device, unb64(handle)))

    def handle(self) -> str:
        return b64(self.event.ipc_handle())

    def record(self, gen: int = 0, stream: torch.cuda.Stream | None = None) -> None:
        self.event.record(stream)

    def wait(self, gen: int = 0, timeout: float | None = None, stream=None) -> None:
        """Make `stream` (default: current) wait on the device; the host does not block."""
        self.event.wait(stream)

    def synchronize(self, gen: int = 0) -> None:
        self.event.synchronize()

    def query(self, gen: int = 0) -> bool:
        return self.event.query()
