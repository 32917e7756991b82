"""Several named tensors in one shared segment: one mapping, one handle per field."""

from __future__ import annotations

import math

import torch

from ipc.cuda import export_cuda
from ipc.handle import TensorHandle, dtype_name, itemsize
from ipc.tensor import SharedTensor, open_handle

_ALIGN = 64

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class SharedBundle:
    """Fields laid out back to back (64-byte aligned) in one segment or CUDA block."""

    def __init__(self, specs: Specs, prefix: str, device: str | torch.device = "cpu"):
        offsets, total = _layout(specs)
        self._base = SharedTensor.create((max(total, _ALIGN),), torch.uint8, prefix, device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.handles: dict[str, TensorHandle] = {}
        base = self._base.tensor
        for name, (shape, dtype) in specs.items():
            n = math.prod(shape) * itemsize(dtype)
            view = base[offsets[name] : offsets[name] + n].view(dtype).view(shape)
            self.tensors[name] = view
            self.handles[name] = _field_handle(self._base.handle, view, offsets[name], shape, dtype)

    def unlink(self) -> None:
        self._base.close()
        self._base.unlink()


def open_bundle(handles: dict[str, TensorHandle]) -> dict[str, torch.Tensor]:
    """Views of every field; the segment is mapped once per process and cached."""
    return {name: open_handle(h) for name, h in handles.items()}


def _layout(specs: Specs) -> tuple[dict[str, int], int]:
    offsets, pos = {}, 0
    for name, (shape, dtype) in specs.items():
        offsets[name] = pos
        pos += -(-math.prod(shape) * itemsize(dtype) // _ALIGN) * _ALIGN
    return offsets, pos


def _field_handle(base: TensorHandle, view: torch.Tensor, offset: int, shape, dtype):
    if base.kind == "cuda":
        return export_cuda(view)
    return TensorHandle(
        "shm", base.name, dtype_name(dtype), tuple(shape), base.offset + offset, base.nbytes
    )
