"""Tensor handles: small, fixed-size descriptions of a tensor living in shared memory."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import msgspec
import torch

from ipc.codec import Message, MessageError

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


DtypeName = Literal[tuple(_DTYPES)]
Extent = Annotated[int, msgspec.Meta(ge=0)]


class TensorHandle(Message):
    """Where a shared tensor lives and how to view it.

    kind: "shm" (POSIX shared memory; `name` is the segment name) or "cuda"
    (CUDA IPC; `name` is the base64 memory handle, `extra` the rest of what the
    consumer needs). `offset` is in bytes from the start of the segment/block.
    The encoded size depends only on the rank, never on the tensor's size.
    """

    kind: Literal["shm", "cuda"]
    name: str
    dtype: DtypeName
    shape: tuple[Extent, ...]
    offset: Extent = 0
    nbytes: Extent = 0
    extra: dict[str, Any] = {}

    @property
    def key(self) -> tuple:
        return (self.kind, self.name, self.dtype, self.shape, self.offset)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__} | {"shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: Any) -> TensorHandle:
        """A handle from its `to_dict` form; ValueError (a MessageError) naming the bad field."""
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            raise MessageError(f"bad tensor handle: {e}") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())
