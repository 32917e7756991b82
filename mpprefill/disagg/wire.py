"""The disagg wire: JSON messages between the router, the decode receiver and the prefill
transfer backend, and their one codec (`encode`, `decode`).

One JSON object per ZeroMQ frame; nothing is pickled. Every message but the router reply
carries a "type" and every field; the router reply has the shape of the server's reply to
its client. (JSON rather than msgpack: these frames are a few hundred bytes, where the two
cost the same, and the router speaks JSON.)

  sender -> receiver      type              fields
  router -> decode        register          rid, bootstrap_room, input_ids
  decode -> router        (none)            rid, status done|error, first_token, verified,
                                            max_abs_err | error
  prefill -> decode       bootstrap         room, tp_size, kv_heads, dtype, kv_layout, kv_dim,
                                            layerwise
  decode -> prefill       bootstrap_reply   room, status ready|unknown|error, pool,
                                            dst_pages, decode_prefix_len, error, instance
  prefill -> decode       layers_written    room, first_page, num_pages, layers, instance
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

NOTE: kv_layout names what the prefill's pool keeps per token and layer: "heads", K and V
per KV head, of kv_dim each; or "latent", one row of kv_dim (multi-head latent attention:
kv_lora_rank + qk_rope_head_dim) that every head's K and V are decompressed from (kv_dim 0:
not named, a prefill of before). The decode refuses a room whose layout is not its own
pool's (`layout_error`), naming both. A latent page is page_size rows of kv_dim per layer:
one plane per layer, where K and V have two (plane_map.py).

NOTE: layerwise. A prefill that writes pages layer by layer says so in its bootstrap
(`layerwise: true`); it then announces every page it writes into the room once all its
layers are in (`layers_written`: the room's sent pages [first_page, first_page +
num_pages), counted as transfer_done counts them, hold layers [0, layers)), and the decode
accepts transfer_done only when every page has all of its layers. A bootstrap leaves out
its fields at their defaults, so one without layer-wise send reads as before to a decode
of before, which refuses a layer-wise one as a malformed frame (the room fails at its
bootstrap, before any page is written); a prefill of before never sets it.

NOTE: `instance` names one run of a decode receiver. The prefill sends back the instance
that answered a room's bootstrap and accepts only that instance's ack, so a receiver that
restarted on the same port never acknowledges pages that went to its predecessor.

The bootstrap endpoint (prefill side, `--disaggregation-bootstrap-port`) takes only
register_room and abort, in frames of at most MAX_REGISTRATION_BYTES; an address is
`host:port` (ADDRESS_RE).

Bounds: a frame is at most MAX_FRAME_BYTES (both sockets of the link set it as their
ZeroMQ MAXMSGSIZE), an integer fits int64, a string MAX_STR characters, and an error
quotes a bad value in at most QUOTE_CHARS characters. They are the fields' types (`Int`,
`Str`), checked as a frame is decoded; an error names the offending field (`$.room`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec

from ipc import codec
from ipc.codec import Codec, MessageError
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

Int = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
Str = Annotated[str, msgspec.Meta(max_length=MAX_STR)]
KVLayout = Literal["heads", "latent"]  # K and V per KV head, or one latent row per token
HeadRange = Annotated[list[Int], msgspec.Meta(min_length=2, max_length=2)]  # [start, stop)
TopPair = tuple[Int, float]  # (token_id, logprob)


def brief(text: str, limit: int = 2 * QUOTE_CHARS) -> str:
    """An error text from or about a peer, cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quote(v: Any) -> str:
    """`repr(v)`, cut to QUOTE_CHARS: what an error message may echo of a peer's value."""
    return brief(repr(v), QUOTE_CHARS)


def check_address(v: Any, name: str = "address") -> str:
    """`v` if it is host:port, port in [1, 65535] (a flag's or a peer's value); MessageError,
    a ValueError, otherwise."""
    m = ADDRESS_RE.fullmatch(v) if isinstance(v, str) else None
    if m is None or not 0 < int(m["port"]) < 65536:
        raise MessageError(f"{name} must be host:port, got {quote(v)}")
    return v


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Shape of a KV pool as both sides see it: [2, num_layers, num_slots, heads, head_dim]
    of K and V per head (kv_layout "heads"), or [1, num_layers, num_slots, 1, head_dim] of
    one latent row per token and layer ("latent": head_dim is the row's width)."""

    dtype: Str
    num_layers: Positive
    num_slots: Positive
    num_kv_heads: Positive
    head_dim: Positive
    page_size: Positive
    kv_layout: KVLayout = "heads"

    @classmethod
    def of(
        cls, buffer: Any, page_size: int, num_layers: int | None = None, latent: bool = False
    ) -> PoolLayout:
        """Layout of a KV buffer [planes, layers, num_slots, heads, head_dim]; `num_layers`:
        the model's, when its SWA layers sit in a pool of their own (KVCache.num_layers);
        `latent`: a latent pool's buffer (KVCache.latent)."""
        _, layers, slots, heads, dim = buffer.shape
        dtype = str(buffer.dtype).removeprefix("torch.")
        kv_layout = "latent" if latent else "heads"
        return cls(dtype, num_layers or layers, slots, heads, dim, page_size, kv_layout)

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def latent(self) -> bool:
        return self.kv_layout == "latent"

    @property
    def kv_text(self) -> str:
        """What the pool keeps per token and layer, in words."""
        return kv_text(self.kv_layout, self.head_dim, self.num_kv_heads)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> PoolLayout:
        """A layout from its `to_dict` form (other keys ignored); MessageError otherwise."""
        try:
            return msgspec.convert(d, cls)
        except msgspec.ValidationError as e:
            raise MessageError(f"pool layout: {e}") from None

    def mismatch(self, other: PoolLayout) -> str | None:
        """Why pages of `self` cannot be copied into `other` (None when they can)."""
        mine, theirs = self.to_dict(), other.to_dict()
        diff = [k for k in mine if k != "num_slots" and mine[k] != theirs[k]]
        return None if not diff else f"pool layouts differ in {diff}: {mine} vs {theirs}"


def kv_text(kv_layout: str, kv_dim: int, num_kv_heads: int | None = None) -> str:
    """A KV layout in words: "latent rows of 576", "K and V of 8 heads x 128"; without
    `num_kv_heads` "K and V of 128 per head" (without `kv_dim` too, "K and V per head")."""
    if kv_layout == "latent":
        return f"latent rows of {kv_dim}"
    if num_kv_heads:
        return f"K and V of {num_kv_heads} heads x {kv_dim}"
    return f"K and V of {kv_dim} per head" if kv_dim else "K and V per head"


def layout_error(kv_layout: str, kv_dim: int, decode: PoolLayout) -> str | None:
    """Why a prefill's pool of `kv_layout` rows of `kv_dim` (0: not named, a prefill of
    before) cannot fill the pool `decode` (None: the same layout)."""
    if kv_layout == decode.kv_layout and kv_dim in (0, decode.head_dim):
        return None
    return (
        f"the prefill's KV pool keeps {kv_text(kv_layout, kv_dim)}, this decode's"
        f" {decode.kv_text} (per token and layer): give both the same model"
    )


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


class Tagged(codec.Message, tag_field="type"):
    """A wire message with a "type" key: every one but the router reply."""


class Register(Tagged, tag="register"):
    rid: Str
    bootstrap_room: Int
    input_ids: Annotated[list[Int], msgspec.Meta(min_length=1)]


class RouterReply(codec.Message, omit_defaults=True):
    """A done reply has no error key, an error reply only its error (null keys left out)."""

    rid: Str
    status: Literal["done", "error"]
    first_token: Int | None = None
    verified: bool | None = None
    max_abs_err: float | None = None
    error: Str | None = None
    # the decode's time.monotonic() as it sent a done reply: CLOCK_MONOTONIC is one clock
    # for every process of a host, so a router on the same host may subtract its own stamps
    emitted_at: float | None = None


class Bootstrap(Tagged, tag="bootstrap", omit_defaults=True):
    room: Int
    tp_size: Positive = 1  # the prefill's tensor-parallel size
    # [start, stop) per pool written
    kv_heads: Annotated[list[HeadRange], msgspec.Meta(max_length=MAX_HEAD_RANGES)] = []
    dtype: Str = ""  # the prefill's KV pool dtype ("": not named)
    kv_layout: KVLayout = "heads"  # what its pool keeps per token and layer
    kv_dim: Int = 0  # its head_dim, or its latent row's width (0: not named)
    layerwise: bool = False  # it writes pages layer by layer and announces them

    def __post_init__(self) -> None:
        # NOTE: start < stop relates two items of a pair: no type says it. (Its length is
        # checked again for a Bootstrap made here rather than decoded.)
        if any(len(r) != 2 or r[0] >= r[1] for r in self.kv_heads):
            raise MessageError(
                f"kv_heads must hold [start, stop] pairs, start < stop: {quote(self.kv_heads)}"
            )


class BootstrapReply(Tagged, tag="bootstrap_reply"):
    room: Int
    status: Literal["ready", "unknown", "error"]
    pool: dict[str, Any] | None = None
    dst_pages: list[Int] = []
    decode_prefix_len: Int = 0
    error: Str | None = None
    instance: Str = ""


class LayersWritten(Tagged, tag="layers_written"):
    room: Int
    first_page: Int  # the k-th page the prefill sent to the room, as transfer_done counts
    num_pages: Int
    layers: Int  # those pages hold the KV of layers [0, layers)
    instance: Str = ""


class TransferDone(Tagged, tag="transfer_done"):
    room: Int
    first_token: Int
    num_pages: Int
    instance: Str = ""
    logprob: float | None = None  # the first token's, under the request's sampling
    # [[token_id, logprob], ...], best first
    top_logprobs: Annotated[list[TopPair], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)] | None = None

    def __post_init__(self) -> None:
        # NOTE: a pair decodes as a tuple (the one fixed-shape array msgspec checks); lists,
        # as TokenLogprob.top holds them.
        if self.top_logprobs and not isinstance(self.top_logprobs[0], list):
            msgspec.structs.force_setattr(
                self, "top_logprobs", [list(p) for p in self.top_logprobs]
            )


class Ack(Tagged, tag="ack"):
    room: Int
    ok: bool
    error: Str | None = None
    instance: Str = ""


class Abort(Tagged, tag="abort"):
    room: Int


class RegisterRoom(Tagged, tag="register_room"):
    room: Int
    address: str  # host:port of the decode receiver that the room's KV goes to

    def __post_init__(self) -> None:
        check_address(self.address)  # NOTE: a port's range is not a pattern msgspec checks


class RoomReply(Tagged, tag="room_reply"):
    room: Int
    ok: bool
    error: Str | None = None
    code: Int | None = None  # a refused request's status at the prefill (protocol.Code)


class Ping(Tagged, tag="ping"):
    pass


class Pong(Tagged, tag="pong"):
    pass


class ErrorReply(Tagged, tag="error"):
    error: Str
    room: Int | None = None


_Typed = Union[  # noqa: UP007
    Register,
    Bootstrap,
    BootstrapReply,
    LayersWritten,
    TransferDone,
    Ack,
    Abort,
    RegisterRoom,
    RoomReply,
    Ping,
    Pong,
    ErrorReply,
]
Message = Union[RouterReply, _Typed]  # noqa: UP007
_TYPED: Codec[_Typed] = Codec(_Typed, "json")
_ROUTER: Codec[RouterReply] = Codec(RouterReply, "json")


class _Ids(msgspec.Struct):
    """What a frame that is not a message may still show (other keys are skipped unread)."""

    type: Any = None
    status: Any = None
    rid: Any = None
    room: Any = None
    bootstrap_room: Any = None


_IDS = msgspec.json.Decoder(_Ids)

# ---- codec ---------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    return (_ROUTER if type(msg) is RouterReply else _TYPED).encode(msg)


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; MessageError (with rid/room when readable) otherwise."""
    try:
        return _TYPED.decode(frame)
    except MessageError as e:
        error = e
    try:
        ids = _IDS.decode(frame)
    except (msgspec.DecodeError, RecursionError):
        raise error from None
    if ids.type is None and ids.status is not None:
        try:
            return _ROUTER.decode(frame)
        except MessageError as e:
            error = e
    rid = ids.rid if isinstance(ids.rid, str) else None
    room = ids.room if ids.room is not None else ids.bootstrap_room
    ok_room = type(room) is int and room >= 0
    raise MessageError(str(error), rid, room=room if ok_room else None) from None
