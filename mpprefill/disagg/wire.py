"""The disagg wire: JSON messages between the router, the decode receiver and the prefill
transfer backend, and their one codec (`encode`, `decode`).

One JSON object per ZeroMQ frame; nothing is pickled. Every message but the router reply
carries a "type"; the router reply has the shape of the server's reply to its client.

  sender -> receiver      type              fields
  router -> decode        register          rid, bootstrap_room, input_ids
  decode -> router        (none)            rid, status done|error, first_token, verified,
                                            max_abs_err | error
  prefill -> decode       bootstrap         room, tp_size, kv_heads, dtype
  decode -> prefill       bootstrap_reply   room, status ready|unknown|error, pool,
                                            dst_pages, decode_prefix_len, error, instance
  prefill -> decode       transfer_done     room, first_token, num_pages, instance,
                                            logprob, top_logprobs (the first token's,
                                            where its request asked; else null)
  decode -> prefill       ack               room, ok, error, instance
  either way              abort             room
  prefill -> decode       ping              (decode answers pong)
  decode -> anyone        error             error, room (a frame it could not use)
  decode -> prefill's     register_room     room, address (the decode's receiver socket)
    bootstrap endpoint
  endpoint -> decode      room_reply        room, ok, error, code (the HTTP status the
                                            prefill gave the request it refused, if any)
  decode -> endpoint      abort             room (withdraws its registration)

NOTE: dst_pages lists every receive page of the room, prompt order. The first
decode_prefix_len // page_size of them already hold KV; the k-th page the prefill side
sends goes to dst_pages[decode_prefix_len // page_size + k].

NOTE: kv_heads lists the [start, stop) KV heads of each pool the prefill writes (one per
distinct range of its tensor-parallel ranks; none: one pool with every head). The decode
accepts the room only if they tile its own pool's heads (`head_tiling_error`), each pool's
heads landing at their offset in every slot.

NOTE: dtype names the prefill's KV pool dtype ("bfloat16", ...; empty: not named, a prefill
of before). The decode refuses a room whose dtype is not its own pool's (`dtype_error`)
before any page is written: pages are copied byte for byte, never converted.

NOTE: `instance` names one run of a decode receiver. The prefill sends back the instance
that answered a room's bootstrap and accepts only that instance's ack, so a receiver that
restarted on the same port never acknowledges pages that went to its predecessor.

The bootstrap endpoint (prefill side, `--disaggregation-bootstrap-port`) takes only
register_room and abort, in frames of at most MAX_REGISTRATION_BYTES; an address is
`host:port` (ADDRESS_RE).

Bounds: a frame is at most MAX_FRAME_BYTES (both sockets of the link set it as their
ZeroMQ MAXMSGSIZE), an integer fits int64, a string MAX_STR characters, and an error
quotes a bad value in at most QUOTE_CHARS characters.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpprefill.sampling.params import MAX_TOP_LOGPROBS

MAX_FRAME_BYTES = 16 << 20  # a register frame of a prompt of ~2M tokens
MAX_INT = 2**63 - 1  # room, page and token numbers are int64 on both sides
MAX_STR = 4096  # rid, error, instance, dtype
MAX_REGISTRATION_BYTES = 1024  # a register_room frame (the bootstrap endpoint's MAXMSGSIZE)
# host:port; the host a name, an IPv4 address or a bracketed IPv6 address
ADDRESS_RE = re.compile(
    r"(?P<host>[A-Za-z0-9._-]{1,255}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>\d{1,5})"
)
QUOTE_CHARS = 80
MAX_HEAD_RANGES = 1024  # KV head ranges in a bootstrap: one per tensor-parallel rank at most


def brief(text: str, limit: int = 2 * QUOTE_CHARS) -> str:
    """An error text from or about a peer, cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote(v: Any) -> str:
    """`repr(v)`, cut to QUOTE_CHARS: what an error message may echo of a peer's value."""
    return brief(repr(v), QUOTE_CHARS)


class WireError(ValueError):
    """A frame that is not a valid message; rid/room are kept when they were readable."""

    def __init__(self, message: str, rid: str | None = None, room: int | None = None):
        super().__init__(message)
        self.rid = rid
        self.room = room


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Shape of a KV pool as both sides see it: [2, num_layers, num_slots, heads, head_dim]."""

    dtype: str
    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    @classmethod
    def of(cls, buffer: Any, page_size: int, num_layers: int | None = None) -> PoolLayout:
        """Layout of a KV buffer [2, layers, num_slots, heads, head_dim]; `num_layers`: the
        model's, when its SWA layers sit in a pool of their own (KVCache.num_layers)."""
        _, layers, slots, heads, dim = buffer.shape
        dtype = str(buffer.dtype).removeprefix("torch.")
        return cls(dtype, num_layers or layers, slots, heads, dim, page_size)

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> PoolLayout:
        if not isinstance(d, dict):
            raise WireError("pool layout must be an object")
        kw = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        checks = {k: _str if k == "dtype" else lambda v, k: _int(v, k, minimum=1) for k in kw}
        return cls(**{k: checks[k](v, f"layout.{k}") for k, v in kw.items()})

    def mismatch(self, other: PoolLayout) -> str | None:
        """Why pages of `self` cannot be copied into `other` (None when they can)."""
        mine, theirs = self.to_dict(), other.to_dict()
        diff = [k for k in mine if k != "num_slots" and mine[k] != theirs[k]]
        return None if not diff else f"pool layouts differ in {diff}: {mine} vs {theirs}"


def head_tiling_error(kv_heads: list[list[int]], num_kv_heads: int, tp_size: int) -> str | None:
    """Why pools holding heads `kv_heads` (a prefill at `tp_size`) cannot fill a pool of
    `num_kv_heads` heads (None: they tile [0, num_kv_heads) exactly, at most one per rank)."""
    if not kv_heads:
        return None if tp_size == 1 else f"a TP {tp_size} prefill named no KV head ranges"
    ranges = sorted(kv_heads)
    starts = [r[0] for r in ranges]
    stops = [r[1] for r in ranges]
    tiled = starts == [0, *stops[:-1]] and stops[-1] == num_kv_heads
    if tiled and len(ranges) <= tp_size:
        return None
    return (
        f"a TP {tp_size} prefill writing KV heads {quote(kv_heads)} does not fill this"
        f" decode's {num_kv_heads} KV heads, each once"
    )


def dtype_error(prefill_dtype: str, decode_dtype: str) -> str | None:
    """Why a prefill's pool of `prefill_dtype` cannot fill a pool of `decode_dtype` (None:
    the same, or the prefill named none)."""
    if not prefill_dtype or prefill_dtype == decode_dtype:
        return None
    return (
        f"the prefill's KV pool is {quote(prefill_dtype)}, this decode's is {decode_dtype}:"
        " give both the same --kv-cache-dtype (or --dtype)"
    )


@dataclass(frozen=True, slots=True)
class Register:
    rid: str
    bootstrap_room: int
    input_ids: list[int]


@dataclass(frozen=True, slots=True)
class RouterReply:
    rid: str
    status: str  # "done" | "error"
    first_token: int | None = None
    verified: bool | None = None
    max_abs_err: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Bootstrap:
    room: int
    tp_size: int = 1  # the prefill's tensor-parallel size
    kv_heads: list[list[int]] = field(default_factory=list)  # [start, stop) per pool written
    dtype: str = ""  # the prefill's KV pool dtype ("": not named)


@dataclass(frozen=True, slots=True)
class BootstrapReply:
    room: int
    status: str  # "ready" | "unknown" | "error"
    pool: dict[str, Any] | None = None
    dst_pages: list[int] = field(default_factory=list)
    decode_prefix_len: int = 0
    error: str | None = None
    instance: str = ""


@dataclass(frozen=True, slots=True)
class TransferDone:
    room: int
    first_token: int
    num_pages: int
    instance: str = ""
    logprob: float | None = None  # the first token's, under the request's sampling
    top_logprobs: list[list] | None = None  # [[token_id, logprob], ...], best first


@dataclass(frozen=True, slots=True)
class Ack:
    room: int
    ok: bool
    error: str | None = None
    instance: str = ""


@dataclass(frozen=True, slots=True)
class Abort:
    room: int


@dataclass(frozen=True, slots=True)
class RegisterRoom:
    room: int
    address: str  # host:port of the decode receiver that the room's KV goes to


@dataclass(frozen=True, slots=True)
class RoomReply:
    room: int
    ok: bool
    error: str | None = None
    code: int | None = None  # a refused request's status at the prefill (protocol.Code)


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Pong:
    pass


@dataclass(frozen=True, slots=True)
class ErrorReply:
    error: str
    room: int | None = None


Message = (
    Register
    | RouterReply
    | Bootstrap
    | BootstrapReply
    | TransferDone
    | Ack
    | Abort
    | RegisterRoom
    | RoomReply
    | Ping
    | Pong
    | ErrorReply
)

# ---- field checks ------------------------------------------------------------------------


def _int(v: Any, name: str, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= MAX_INT:
        raise WireError(f"{name} must be an integer in [{minimum}, 2**63), got {quote(v)}")
    return v


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_STR:
        raise WireError(f"{name} must be a string of at most {MAX_STR} characters: {quote(v)}")
    return v


def _ints(v: Any, name: str) -> list[int]:
    if not isinstance(v, list):
        raise WireError(f"{name} must be a list of integers")
    return [_int(x, name) for x in v]


def _head_ranges(v: Any, name: str) -> list[list[int]]:
    """[[start, stop], ...], each 0 <= start < stop, at most MAX_HEAD_RANGES of them."""
    if not isinstance(v, list) or len(v) > MAX_HEAD_RANGES:
        raise WireError(f"{name} must be a list of at most {MAX_HEAD_RANGES} [start, stop] pairs")
    ranges = [_ints(r, name) for r in v]
    if any(len(r) != 2 or r[0] >= r[1] for r in ranges):
        raise WireError(f"{name} must hold [start, stop] pairs with start < stop: {quote(v)}")
    return ranges


def check_address(v: Any, name: str = "address") -> str:
    """`v` if it is host:port, port in [1, 65535] (a flag's or a peer's value); WireError,
    a ValueError, otherwise."""
    m = ADDRESS_RE.fullmatch(v) if isinstance(v, str) else None
    if m is None or not 0 < int(m["port"]) < 65536:
        raise WireError(f"{name} must be host:port, got {quote(v)}")
    return v


def _tokens(v: Any, name: str) -> list[int]:
    ids = _ints(v, name)
    if not ids:
        raise WireError(f"{name} must not be empty")
    return ids


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def check(v: Any, name: str) -> str:
        if v not in allowed:
            raise WireError(f"{name} must be one of {allowed}, got {quote(v)}")
        return v

    return check


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda v, name: None if v is None else check(v, name)


def _typed(*types: type) -> Callable[[Any, str], Any]:
    """Exactly these JSON types (a bool is not a number here)."""

    def check(v: Any, name: str) -> Any:
        if isinstance(v, bool) != (bool in types) or not isinstance(v, types):
            raise WireError(f"{name} must be {'/'.join(t.__name__ for t in types)}: {quote(v)}")
        return v

    return check


_bool, _float, _object = _typed(bool), _typed(int, float), _typed(dict)


def _top_logprobs(v: Any, name: str) -> list[list]:
    """[[token_id, logprob], ...], at most MAX_TOP_LOGPROBS pairs."""
    if not isinstance(v, list) or len(v) > MAX_TOP_LOGPROBS:
        raise WireError(f"{name} must be a list of at most {MAX_TOP_LOGPROBS} pairs")
    for pair in v:
        if not isinstance(pair, list) or len(pair) != 2:
            raise WireError(f"{name} must hold [token_id, logprob] pairs: {quote(pair)}")
        _int(pair[0], name)
        _float(pair[1], name)
    return v


_S = {
    "register": (Register, {"rid": _str, "bootstrap_room": _int, "input_ids": _tokens}),
    "bootstrap": (
        Bootstrap,
        {
            "room": _int,
            "tp_size": lambda v, n: _int(v, n, minimum=1),
            "kv_heads": _head_ranges,
            "dtype": _str,
        },
    ),
    "bootstrap_reply": (
        BootstrapReply,
        {
            "room": _int,
            "status": _choice("ready", "unknown", "error"),
            "pool": _optional(_object),
            "dst_pages": _ints,
            "decode_prefix_len": _int,
            "error": _optional(_str),
            "instance": _str,
        },
    ),
    "transfer_done": (
        TransferDone,
        {
            "room": _int,
            "first_token": _int,
            "num_pages": _int,
            "instance": _str,
            "logprob": _optional(_float),
            "top_logprobs": _optional(_top_logprobs),
        },
    ),
    "ack": (Ack, {"room": _int, "ok": _bool, "error": _optional(_str), "instance": _str}),
    "abort": (Abort, {"room": _int}),
    "register_room": (RegisterRoom, {"room": _int, "address": check_address}),
    "room_reply": (
        RoomReply,
        {"room": _int, "ok": _bool, "error": _optional(_str), "code": _optional(_int)},
    ),
    "ping": (Ping, {}),
    "pong": (Pong, {}),
    "error": (ErrorReply, {"error": _str, "room": _optional(_int)}),
}
_ROUTER_REPLY = {
    "rid": _str,
    "status": _choice("done", "error"),
    "first_token": _optional(_int),
    "verified": _optional(_bool),
    "max_abs_err": _optional(_float),
    "error": _optional(_str),
}
_TYPES = {cls: name for name, (cls, _) in _S.items()}

# ---- codec ---------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    if isinstance(msg, RouterReply):
        keep = ("first_token", "verified", "max_abs_err") if msg.status == "done" else ("error",)
        body = {"rid": msg.rid, "status": msg.status, **{k: body[k] for k in keep}}
    else:
        body = {"type": _TYPES[type(msg)], **body}
    return json.dumps(body, separators=(",", ":")).encode()


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; WireError (with rid/room when readable) otherwise."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise WireError(f"frame is not JSON: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise WireError("frame is not a JSON object")
    try:
        return _build(obj)
    except WireError as e:
        raise WireError(str(e), *_readable_ids(obj)) from None


def _build(obj: dict[str, Any]) -> Message:
    kind = obj.get("type")
    if kind is None and "status" in obj and "rid" in obj:
        cls, schema = RouterReply, _ROUTER_REPLY
    elif isinstance(kind, str) and kind in _S:
        cls, schema = _S[kind]
    else:
        raise WireError(f"unknown message type {quote(kind)}")
    required = {f.name for f in dataclasses.fields(cls) if _required(f)}
    missing = sorted(required - set(obj))
    if missing:
        raise WireError(f"{kind or 'reply'}: missing fields {missing}")
    return cls(**{name: check(obj[name], name) for name, check in schema.items() if name in obj})


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _readable_ids(obj: dict[str, Any]) -> tuple[str | None, int | None]:
    rid = obj.get("rid") if isinstance(obj.get("rid"), str) else None
    room = obj.get("room", obj.get("bootstrap_room"))
    ok_room = isinstance(room, int) and not isinstance(room, bool) and room >= 0
    return rid, room if ok_room else None
