"""Explicit message codec: registered dataclasses <-> JSON bytes. Nothing is pickled."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from ipc.handle import TensorHandle

T = TypeVar("T")
_REGISTRY: dict[str, type] = {}


class CodecError(ValueError):
    pass


def message(cls: type[T]) -> type[T]:
    """Register a dataclass as a message type under its class name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass")
    if cls.__name__ in _REGISTRY and _REGISTRY[cls.__name__] is not cls:
        raise TypeError(f"message type {cls.__name__} registered twice")
    _REGISTRY[cls.__name__] = cls
    return cls


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if _REGISTRY.get(name) is not type(msg):
        raise CodecError(f"{name} is not a registered message type")
    body = {f.name: _to_json(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    return json.dumps({"t": name, "b": body}, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    try:
        obj = json.loads(data)
        cls = _REGISTRY[obj["t"]]
        body = obj["b"]
    except (ValueError, KeyError, TypeError) as e:
        raise CodecError(f"undecodable message: {e}") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(body) - set(fields)
    if unknown:
        raise CodecError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**{k: _from_json(v) for k, v in body.items()})


def _to_json(v: Any) -> Any:
    if isinstance(v, TensorHandle):
        return {"__handle__": v.to_dict()}
    if isinstance(v, tuple | list):
        return [_to_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _to_json(x) for k, x in v.items()}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise CodecError(f"cannot encode value of type {type(v).__name__}")


def _from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if "__handle__" in v:
            return TensorHandle.from_dict(v["__handle__"])
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v
