"""CUDA IPC: export a CUDA tensor as a handle, open it once per process, and events.

A CUDA IPC memory handle covers the whole block of the caching allocator, so the
consumer rebuilds the tensor from the block's base plus the storage offset; torch's
own rebuild does that, and also keeps the producer's block alive (a shared
reference counter) until every consumer has released it. A handle can be opened
only once per process, hence the cache.

Events: `CudaGenEvent` (both peers use CUDA) and `HostFencedEvent` (the peer does not)
follow the generation API of `ipc.events`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from ipc.events import ShmEvent, poll_until
from ipc.handle import TensorHandle, b64, dtype_from_name, dtype_name, unb64

_open_cache: dict[tuple, torch.Tensor] = {}
_cache_lock = threading.Lock()


def export_cuda(t: torch.Tensor) -> TensorHandle:
    """A handle for a contiguous CUDA tensor. The caller keeps `t` alive meanwhile."""
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
        t = _open_cache.get(_key(h))
        if t is None:
            t = _rebuild(h)
            _open_cache[_key(h)] = t
        return t


def _key(h: TensorHandle) -> tuple:
    # NOTE: fields of one bundle share the block handle and its byte offset; only the
    # element offset inside the storage tells same-shaped fields apart.
    return (*h.key, h.extra.get("storage_offset_elems"), tuple(h.extra.get("stride", ())))


def _rebuild(h: TensorHandle) -> torch.Tensor:
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
        _open_cache.pop(_key(h), None)


def pin(t: torch.Tensor) -> bool:
    """Page-lock host memory `t` covers (a shared segment, say) so copies to and from the
    device run asynchronously; False when the runtime refuses."""
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return int(rc) == 0


class CudaIpcEvent:
    """An interprocess CUDA event: record, wait and query act on the latest record."""

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

    def record(self, stream: torch.cuda.Stream | None = None) -> None:
        self.event.record(stream)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: current) wait on the device; the host does not block."""
        self.event.wait(stream)

    def query(self) -> bool:
        return self.event.query()


class CudaGenEvent:
    """A generation counter (`ShmEvent`) over an interprocess CUDA event.

    NOTE: a CUDA wait or query sees only the latest record. `record(gen)` records on the
    current stream first and publishes `gen` after, and waiters first wait (on the host)
    for `gen` to be published, so the record they then wait on is that generation's or a
    later one, never an earlier one. Waiting on a later record only waits longer.
    """

    def __init__(self, counter: ShmEvent, event: CudaIpcEvent):
        self.counter, self.event, self.name = counter, event, counter.name

    def record(self, gen: int) -> None:
        self.event.record()
        self.counter.record(gen)

    def wait(
        self, gen: int, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> None:
        """The current stream's later work runs after `gen`; the host blocks only until
        `gen` was recorded."""
        self.counter.wait(gen, timeout, alive)
        self.event.wait()

    def synchronize(
        self, gen: int, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> None:
        """Block the host until the work before `gen`'s record is complete."""
        self.counter.wait(gen, timeout, alive)
        poll_until(self.event.query, f"{self.name} generation {gen}", timeout, alive, 2e-4)

    def query(self, gen: int) -> bool:
        return self.counter.query(gen) and self.event.query()

    def flush(self) -> None:
        pass


class HostFencedEvent:
    """An event a CUDA process records for a peer that never touches CUDA: `record`
    marks a point on the current stream, `flush` waits for it and only then publishes
    the generation in the shared counter the peer waits on."""

    def __init__(self, counter: ShmEvent):
        self.counter, self.name = counter, counter.name
        self._pending: list[tuple[int, torch.cuda.Event]] = []

    def record(self, gen: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self._pending.append((gen, event))

    def flush(self) -> None:
        for gen, event in self._pending:
            event.synchronize()
            self.counter.record(gen)
        self._pending.clear()

    def wait(
        self, gen: int, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> None:
        self.counter.wait(gen, timeout, alive)

    synchronize = wait

    def query(self, gen: int) -> bool:
        return self.counter.query(gen)


class PolledEvent(HostFencedEvent):
    """An event a CUDA process records for host readers that must see each record as soon
    as its work completes, not at the next `flush`: every `record` marks a point on the
    current stream and a thread of its own waits for it, then publishes the generation in
    the shared counter. Records complete in stream order, so the counter only grows."""

    def __init__(self, counter: ShmEvent):
        super().__init__(counter)
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._publish, name=f"poll-{self.name}", daemon=True)
        self._thread.start()

    def record(self, gen: int) -> None:
        event = torch.cuda.Event()
        event.record()
        with self._cv:
            self._pending.append((gen, event))
            self._cv.notify_all()

    def _publish(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                gen, event = self._pending[0]
            event.synchronize()
            self.counter.record(gen)
            with self._cv:
                self._pending.pop(0)

    def flush(self) -> None:
        """Nothing to do: the thread publishes each record as soon as it completes (a
        reply must not wait for the device here)."""
