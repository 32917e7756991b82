"""A forward's guard: it counts the torch calls a forward issues and fails any read of the
batch's device-side tensors back to the host, on any device.

On a GPU such a read (`.tolist()`, `.item()`, `bool(t)`, `int(t)`, a boolean-mask index,
`nonzero`, ...) waits for the device to finish everything issued before it, so the host
cannot issue batch N + 1 while batch N runs. On the CPU nothing waits, so nothing would
show it: the guard marks the batch's tensors as device memory (`DeviceTensor`, a subclass
that every result computed from them inherits) and raises `DeviceRead` where the host
would read one. Tensors the host builds itself (plans from the host lengths) stay plain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from mpprefill.model.forward_batch import ForwardBatch

_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
    torch.unique,
    torch.Tensor.unique,
    torch.equal,
}


class DeviceRead(RuntimeError):
    """A forward read a device tensor back to the host."""


class DeviceTensor(torch.Tensor):
    """A tensor standing for device memory: reading it back on the host raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or _syncs(func, args, kwargs):
            name = getattr(func, "__name__", str(func))
            raise DeviceRead(f"the forward read a device tensor back to the host ({name})")
        return super().__torch_function__(func, types, args, kwargs)


def _syncs(func, args, kwargs) -> bool:
    """Calls that wait for the device only with some arguments."""
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    if func is torch.Tensor.__getitem__:
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in parts)
    return False


class _Counter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class ForwardGuard:
    """`with guard.watch(fb) as guarded:` run the forward on `guarded`; then `guard.calls`
    holds the torch calls it issued (every call under the mode, host plans included)."""

    def __init__(self) -> None:
        self.calls = 0

    @contextlib.contextmanager
    def watch(self, fb: ForwardBatch) -> Iterator[ForwardBatch]:
        guarded = fb.map_tensors(lambda t: t.as_subclass(DeviceTensor))
        counter = _Counter()
        with counter:
            yield guarded
        self.calls = counter.calls


def plain(t: torch.Tensor) -> torch.Tensor:
    """A guarded forward's output as an ordinary tensor again."""
    return t.as_subclass(torch.Tensor) if isinstance(t, DeviceTensor) else t
