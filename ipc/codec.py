"""Typed messages: msgspec Structs, one encoder and decoder per union, one error type.

Nothing is pickled. A message is a `Message` subclass; its fields' types and `msgspec.Meta`
bounds are its validation, checked as a frame is decoded. A `Codec` encodes and decodes one
union of tagged messages (the tag is the `type` key) in JSON or msgpack; every frame it
cannot decode, and every message that breaks its type's rules, is a `MessageError`.

The mailboxes' union is the set of messages registered with `@message` (tagged by class
name), encoded as msgpack: `encode` and `decode` below.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar, Union

import msgspec

T = TypeVar("T")
Format = Literal["json", "msgpack"]
ERROR_CHARS = 320  # of a decode error's text: it may quote any value the frame held


class MessageError(ValueError):
    """A frame that cannot be decoded, or a message that breaks its type's rules.

    `rid` and `room` name the request and the transfer it was about, when they could be
    read; `code` is the status a reply to it carries (None: the receiver's default).
    """

    def __init__(
        self, message: str, rid: str | None = None, code: int | None = None, room: int | None = None
    ):
        super().__init__(message)
        self.rid = rid
        self.code = code
        self.room = room


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The base of every message: unknown fields refused, immutable once made. A family of
    messages whose frames leave out fields at their defaults says `omit_defaults=True`."""


class Codec(Generic[T]):
    """The encoder and decoder of one message type: a Struct or a union of tagged Structs."""

    def __init__(self, kind: Any, fmt: Format = "json"):
        lib = msgspec.json if fmt == "json" else msgspec.msgpack
        self.kind = kind
        self.fmt = fmt
        self.types = frozenset(getattr(kind, "__args__", (kind,)))
        self._encoder = lib.Encoder()
        self._decoder = lib.Decoder(kind)

    def encode(self, msg: T) -> bytes:
        if type(msg) not in self.types:
            raise MessageError(f"{type(msg).__name__} is not a message of this codec")
        try:
            return self._encoder.encode(msg)
        except (TypeError, ValueError, OverflowError) as e:
            raise MessageError(f"cannot encode {type(msg).__name__}: {e}") from None

    def decode(self, data: bytes | memoryview) -> T:
        """One message; MessageError (its text names the offending field) otherwise."""
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as e:
            raise MessageError(_cut(str(e))) from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise MessageError(f"frame is not {_NAMES[self.fmt]} ({_cut(str(e))})") from None


def _cut(text: str, limit: int = ERROR_CHARS) -> str:
    """`text` at most `limit` characters, its middle dropped: a peer's value quoted in it
    is cut, the field's path at its end kept."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


_NAMES = {"json": "JSON", "msgpack": "msgpack"}
_REGISTRY: dict[str, type] = {}
_mailbox: Codec | None = None


def message(cls: type[T]) -> type[T]:
    """Register a tagged `Message` as one of the mailboxes' messages."""
    tag = getattr(cls, "__struct_config__", None) and cls.__struct_config__.tag
    if not (isinstance(cls, type) and issubclass(cls, Message)) or tag is None:
        raise TypeError(f"{cls.__name__} must be a tagged Message (class X(Message, tag=True))")
    if _REGISTRY.get(tag, cls) is not cls:
        raise TypeError(f"message type {tag} registered twice")
    global _mailbox
    _REGISTRY[tag] = cls
    _mailbox = None
    return cls


def _codec() -> Codec:
    global _mailbox
    if _mailbox is None:
        if not _REGISTRY:
            raise MessageError("no message type is registered")
        _mailbox = Codec(Union[tuple(_REGISTRY.values())], "msgpack")  # noqa: UP007
    return _mailbox


def encode(msg: Any) -> bytes:
    """A registered message as a mailbox frame."""
    return _codec().encode(msg)


def decode(data: bytes) -> Any:
    """A mailbox frame as its registered message."""
    return _codec().decode(data)
