"""Tensor handles: small, fixed-size descriptions of a tensor living in shared memory."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype for shared tensors: {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name: {name!r}") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class TensorHandle:
    """Where a shared tensor lives and how to view it.

    kind: "shm" (POSIX shared memory; `name` is the segment name) or "cuda"
    (CUDA IPC; `name` is the base64 memory handle, `extra` the rest of what the
    consumer needs). `offset` is in bytes from the start of the segment/block.
    The encoded size depends only on the rank, never on the tensor's size.
    """

    kind: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.kind, self.name, self.dtype, self.shape, self.offset)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorHandle:
        if d.get("kind") not in ("shm", "cuda"):
            raise ValueError(f"bad tensor handle kind: {d.get('kind')!r}")
        shape = tuple(int(s) for s in d["shape"])
        if any(s < 0 for s in shape):
            raise ValueError(f"bad tensor handle shape: {shape}")
        dtype_from_name(d["dtype"])
        return cls(
            kind=d["kind"],
            name=str(d["name"]),
            dtype=d["dtype"],
            shape=shape,
            offset=int(d.get("offset", 0)),
            nbytes=int(d.get("nbytes", 0)),
            extra=dict(d.get("extra", {})),
        )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())
