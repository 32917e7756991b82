"""One API over both backends: create, export a handle, open from a handle, close, unlink."""

from __future__ import annotations

import math
import threading

import torch

from ipc import cuda as _cuda
from ipc.handle import TensorHandle, dtype_from_name, dtype_name, itemsize
from ipc.shm import Segment

_ALIGN = 64
_open_cache: dict[tuple, torch.Tensor] = {}
_open_segments: dict[str, Segment] = {}
_cache_lock = threading.Lock()


class SharedTensor:
    """A tensor another process can open from `handle`. The creator owns and unlinks it."""

    def __init__(self, tensor: torch.Tensor, handle: TensorHandle, segment: Segment | None):
        self.tensor, self.handle, self._segment = tensor, handle, segment

    @classmethod
    def create(
        cls,
        shape: tuple[int, ...] | list[int],
        dtype: torch.dtype,
        prefix: str,
        device: str | torch.device = "cpu",
        populate: bool = False,
    ) -> SharedTensor:
        """A zeroed tensor. `populate` (host memory): allocate every page now and map it
        in this process, so that its first writes take no page faults (and a full
        /dev/shm fails here). Otherwise a page is allocated at its first touch, a fault
        per 4 KiB (about 1.5 µs each here), charged to whoever writes it first: for a KV
        pool, the forward."""
        shape = tuple(int(s) for s in shape)
        device = torch.device(device)
        if device.type == "cuda":
            t = torch.zeros(shape, dtype=dtype, device=device)
            return cls(t, _cuda.export_cuda(t), None)
        if device.type != "cpu":
            raise ValueError(f"unsupported device for shared tensors: {device}")
        nbytes = math.prod(shape) * itemsize(dtype)
        seg = Segment.create(prefix, max(nbytes, _ALIGN), reserve=populate)
        t = _view(seg, dtype, shape, 0)
        if populate:
            t.zero_()  # maps every page; NOTE: MAP_POPULATE took longer here
        h = TensorHandle("shm", seg.name, dtype_name(dtype), shape, 0, seg.size)
        return cls(t, h, seg)

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()

    def unlink(self) -> None:
        if self._segment is not None:
            self._segment.unlink()

    def __enter__(self) -> SharedTensor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.unlink()


def open_handle(h: TensorHandle) -> torch.Tensor:
    """A zero-copy view of the tensor behind `h`; repeated opens reuse the mapping."""
    if h.kind == "cuda":
        return _cuda.open_cuda(h)
    with _cache_lock:
        t = _open_cache.get(h.key)
        if t is None:
            seg = _open_segments.get(h.name) or Segment.open(h.name)
            _open_segments[h.name] = seg
            t = _view(seg, dtype_from_name(h.dtype), h.shape, h.offset)
            _open_cache[h.key] = t
        return t


def close_handle(h: TensorHandle) -> None:
    """Forget this process's mapping of `h` (views already handed out stay valid)."""
    if h.kind == "cuda":
        _cuda.release_cuda(h)
        return
    with _cache_lock:
        for key in [k for k in _open_cache if k[1] == h.name]:
            del _open_cache[key]
        seg = _open_segments.pop(h.name, None)
    if seg is not None:
        seg.close()


def _view(seg: Segment, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(seg.buffer, dtype=dtype, count=count, offset=offset)
    return flat.view(shape)
