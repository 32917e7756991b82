"""The client <-> prefill server request protocol: one JSON object per frame.

Frame sizes, three tiers (the server's socket enforces the last one):

| frame size                              | what happens                                 |
|-----------------------------------------|----------------------------------------------|
| <= MAX_FRAME_BYTES (4 MiB)              | parsed; a bad frame gets an error reply      |
| MAX_FRAME_BYTES < n <= MAX_WIRE_BYTES   | not parsed; error reply (rid from its head)  |
| > MAX_WIRE_BYTES (64 MiB)               | ZeroMQ drops it and the connection before    |
|                                         | allocating it (ZMQ_MAXMSGSIZE): no reply     |

An error reply carries at most MAX_RID_CHARS of the rid and MAX_ERROR_CHARS of the reason,
whatever the frame held: a refused frame's rid may be of any length. The prefill server's
also carry a `code`, the HTTP status the reason stands for (the `Code` table below), so a
front maps errors to statuses without reading the reason's words; a client that knows no
codes ignores it.

The server's ROUTER (`bind_server_socket`), and why each limit is there:

- REPLY_HWM: replies queued per client. A client that never reads fills its queue; the
  ROUTER is mandatory, so a further reply raises instead of queueing and is counted
  and logged as dropped. Its request was released before: server memory stays flat.
- REQUEST_HWM: frames queued per client before TCP pushes back on the client; with
  MAX_WIRE_BYTES it bounds what one client can make the server buffer (REQUEST_HWM frames
  of up to MAX_WIRE_BYTES each).
- It binds where `--host` says: 127.0.0.1 by default, loopback only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union

import msgspec
import zmq

from ipc.codec import Codec, Message, MessageError
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.token_logprob import TokenLogprob

MAX_FRAME_BYTES = 4 << 20
MAX_WIRE_BYTES = 64 << 20
MAX_RID_CHARS = 256
MAX_ERROR_CHARS = 1024
MAX_ROOM = 2**63 - 1
MAX_HOST_CHARS = 255  # bootstrap rooms are int64 on every transfer backend
MAX_PATH_CHARS = 4096
REPLY_HWM = 8192
REQUEST_HWM = 256
SNIFF_BYTES = 1024  # head of an oversize frame searched for its rid
# A rid that is the object's first key, or its second after a string "type".
_HEAD_RID = re.compile(
    rb'\A\s*\{\s*(?:"type"\s*:\s*"[^"\\]{0,32}"\s*,\s*)?"rid"\s*:\s*("(?:[^"\\]|\\.){1,512}?")'
)


class Code:
    """An error reply's `code`: the HTTP status of its reason.

    | code | the request                                                        |
    |------|--------------------------------------------------------------------|
    | 400  | is malformed or can never run here (vocabulary, context, pool)     |
    | 404  | names a rid this client has not in flight (an abort's reply)       |
    | 413  | is a frame over MAX_FRAME_BYTES                                    |
    | 429  | found the queue full (`overloaded`): try again later               |
    | 499  | was aborted by its client                                          |
    | 500  | failed inside the server (worker, bootstrap or KV transfer)        |
    | 503  | reached a server that is shutting down                             |
    """

    BAD_REQUEST = 400
    UNKNOWN_RID = 404
    TOO_LARGE = 413
    OVERLOADED = 429
    ABORTED = 499
    INTERNAL = 500
    UNAVAILABLE = 503


ABORTED = "aborted by client"  # the reason of a request its client aborted
# NOTE: the only reason of an abort's own reply (a rid that client has not in flight); no
# generate ever fails with it, so a front drops it instead of routing it to a request.
UNKNOWN_RID = "unknown rid"

Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_RID_CHARS)]
Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_CHARS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Activity = Literal["CPU", "GPU", "MEM"]  # SGLang's torch profiler activities
PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")

# ---- client -> server ------------------------------------------------------------------


class Request(Message, tag_field="type", omit_defaults=True):
    """A frame a client sends; its `type` key names the kind, a field at its default is
    left out."""


class Generate(Request, tag="generate"):
    rid: Rid
    input_ids: list[int]
    # NOTE: decoded as the frame's JSON object, then SamplingParams.from_dict in
    # __post_init__: its ranges and its refusal of unknown keys are SamplingParams' own
    # rules, which msgspec does not apply to a dataclass. Holds a SamplingParams once made.
    sampling_params: Any = None
    bootstrap_room: Room | None = None
    # Where the prefill that computes this room's KV serves its bootstrap endpoint (a decode
    # side's request; the prefill side ignores them, as SGLang's does).
    bootstrap_host: Host | None = None
    bootstrap_port: Port | None = None
    stream: bool = False  # the decode side sends "partial" replies as tokens come

    def __post_init__(self) -> None:
        if not isinstance(self.sampling_params, SamplingParams):
            params = SamplingParams.from_dict(self.sampling_params)
            msgspec.structs.force_setattr(self, "sampling_params", params)


class Abort(Request, tag="abort"):
    rid: Rid


class Stats(Request, tag="stats"):
    rid: Rid | None = None  # echoed in the reply when given


class FlushCache(Request, tag="flush_cache"):
    """Drop the prefix cache, only while no request is live (SGLang's /flush_cache)."""

    rid: Rid | None = None


class StartProfile(Request, tag="start_profile"):
    """Trace the scheduler and forward processes into `output_dir` until StopProfile, or
    for `num_steps` forwards when given; `activities` (SGLang's) run torch's profiler in
    the forward's process too (none: spans only; null: CPU and GPU)."""

    rid: Rid | None
    output_dir: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    num_steps: Annotated[int, msgspec.Meta(ge=1)] | None = None
    activities: tuple[Activity, ...] | None = ("CPU", "GPU")

    def __post_init__(self) -> None:
        if self.activities is None:
            msgspec.structs.force_setattr(self, "activities", ("CPU", "GPU"))


class StopProfile(Request, tag="stop_profile"):
    rid: Rid | None = None


AnyRequest = Union[Generate, Abort, Stats, FlushCache, StartProfile, StopProfile]  # noqa: UP007
REQUESTS: Codec[AnyRequest] = Codec(AnyRequest, "json")


class _Head(msgspec.Struct):
    """What an unusable frame may still show: its rid (other keys are skipped unread)."""

    rid: Any = None


_HEAD = msgspec.json.Decoder(_Head)


class _BootstrapFields(Message):
    bootstrap_room: Room | None = None
    bootstrap_host: Host | None = None
    bootstrap_port: Port | None = None


def parse_frame(frame: bytes | memoryview) -> AnyRequest:
    """Parse one frame; MessageError (with the rid when readable, and the `code` of its
    error reply) for anything unusable."""
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(
            f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes",
            sniff_rid(bytes(frame[:SNIFF_BYTES])),
            Code.TOO_LARGE,
        )
    try:
        return REQUESTS.decode(frame)
    except MessageError as e:
        raise MessageError(str(e), _readable_rid(frame), Code.BAD_REQUEST) from None


def _readable_rid(frame: bytes | memoryview) -> str | None:
    """The rid of a frame that is no request. NOTE: Python's json reads what msgspec refuses
    (NaN, Infinity), so a frame holding them still gets its reply to its rid."""
    try:
        rid = _HEAD.decode(frame).rid
    except (msgspec.DecodeError, RecursionError):
        try:
            obj = json.loads(bytes(frame))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return sniff_rid(bytes(frame[:SNIFF_BYTES]))
        rid = obj.get("rid") if isinstance(obj, dict) else None
        if isinstance(rid, str) and not _utf8(rid):
            rid = None  # a lone surrogate (Python's json reads one) cannot go back in a reply
    return rid if isinstance(rid, str) and rid else None


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def sniff_rid(head: bytes) -> str | None:
    """The rid of a frame too large to parse, when its head shows it unambiguously."""
    m = _HEAD_RID.match(head)
    if m is None:
        return None
    try:
        rid = msgspec.json.decode(m.group(1))
    except msgspec.DecodeError:
        return None
    return rid if isinstance(rid, str) and rid else None


def bootstrap_error(room: Any, host: Any, port: Any) -> str | None:
    """Why these bootstrap fields (None: not given) are not ones a server takes, or None."""
    fields = {"bootstrap_room": room, "bootstrap_host": host, "bootstrap_port": port}
    try:
        msgspec.convert(fields, _BootstrapFields)
    except msgspec.ValidationError as e:
        return str(e)
    return None


def generate_frame(
    rid: str,
    input_ids: list[int],
    sampling_params: dict[str, Any] | None = None,
    bootstrap_room: int | None = None,
    bootstrap_host: str | None = None,
    bootstrap_port: int | None = None,
    stream: bool = False,
) -> bytes:
    """A client's generate frame: greedy unless `sampling_params` says otherwise; no
    `bootstrap_*` or `stream` key when none is given. The client's sampling_params go as
    given (a Generate would check them here: the server does, and answers)."""
    # NOTE: rid right after type, so `sniff_rid` can read it from an oversize frame's head.
    msg: dict[str, Any] = {"type": "generate", "rid": rid, "input_ids": input_ids}
    msg["sampling_params"] = sampling_params or {"temperature": 0.0}
    optional = {
        "bootstrap_room": bootstrap_room,
        "bootstrap_host": bootstrap_host,
        "bootstrap_port": bootstrap_port,
    }
    msg.update((k, v) for k, v in optional.items() if v is not None)
    if stream:
        msg["stream"] = True
    return _JSON.encode(msg)


def abort_frame(rid: str) -> bytes:
    return REQUESTS.encode(Abort(rid))


# The requests a front sends by kind, with a rid and the fields its body gave.
CONTROLS: dict[str, type[Request]] = {
    "stats": Stats,
    "flush_cache": FlushCache,
    "start_profile": StartProfile,
    "stop_profile": StopProfile,
}


def request_frame(msg: AnyRequest) -> bytes:
    """Any request but a generate (whose sampling_params `generate_frame` sends as given)."""
    return REQUESTS.encode(msg)


# ---- server -> client ------------------------------------------------------------------


class Reply(Message, tag_field="status", omit_defaults=True):
    """A server's reply; its `status` key names the kind, a field at its default (no
    logprobs, no code) is left out."""


class DoneReply(Reply, tag="done"):
    rid: str
    first_token: int
    prompt_tokens: int
    cached_tokens: int
    output_ids: list[int]
    completion_tokens: int
    finish_reason: dict[str, Any]
    output_token_logprobs: list[float | None] | None = None
    output_top_logprobs: list[list[list]] | None = None


class PartialReply(Reply, tag="partial"):
    rid: str
    output_ids: list[int]
    output_token_logprobs: list[float | None] | None = None
    output_top_logprobs: list[list[list]] | None = None


class ErrorReply(Reply, tag="error"):
    rid: str | None  # always sent, null when the frame showed none
    error: str
    code: int | None = None


AnyReply = Union[DoneReply, PartialReply, ErrorReply]  # noqa: UP007
REPLIES: Codec[AnyReply] = Codec(AnyReply, "json")
_JSON = msgspec.json.Encoder()


def done_reply(
    rid: str,
    first_token: int,
    prompt_tokens: int,
    cached_tokens: int,
    output_ids: list[int] | None = None,
    finish_reason: dict[str, Any] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    top_logprobs: bool = False,
) -> bytes:
    """A finished request. The prefill side's output is its one sampled token; a decode
    side's is every token it generated, the prefill's first token first. `logprobs` (one
    per output token, where the request asked): `output_token_logprobs`, and with
    `top_logprobs` (it asked for top_logprobs_num > 0) `output_top_logprobs`."""
    output_ids = [first_token] if output_ids is None else output_ids
    if finish_reason is None:
        finish_reason = {"type": "length", "length": len(output_ids)}
    reply = DoneReply(
        rid,
        first_token,
        prompt_tokens,
        cached_tokens,
        output_ids,
        len(output_ids),
        finish_reason,
        *_logprob_fields(logprobs, top_logprobs),
    )
    return REPLIES.encode(reply)


def partial_reply(
    rid: str,
    output_ids: list[int],
    logprobs: Sequence[TokenLogprob] | None = None,
    top_logprobs: bool = False,
) -> bytes:
    """A streamed request's tokens generated since its previous reply; its last reply is a
    done (or error) reply, which repeats every token. Logprobs as in `done_reply`, of these
    tokens."""
    return REPLIES.encode(PartialReply(rid, output_ids, *_logprob_fields(logprobs, top_logprobs)))


def _logprob_fields(logprobs: Sequence[TokenLogprob] | None, top: bool) -> tuple[Any, Any]:
    """`output_token_logprobs` (a float per token; null where unknown) and, with `top`,
    `output_top_logprobs` (per token a list of [token_id, logprob] pairs, best first)."""
    if logprobs is None:
        return None, None
    return [t.logprob for t in logprobs], [t.top for t in logprobs] if top else None


def error_reply(rid: str | None, error: str, code: int | None = None) -> bytes:
    """NOTE: the rid and the reason are cut (not refused: they may come from any frame), so
    a reply stays small whatever was sent. Without a `code` the reply has none (a client
    then reads the status from the reason)."""
    rid = rid[:MAX_RID_CHARS] if rid is not None else None
    return REPLIES.encode(ErrorReply(rid, _cut(error, MAX_ERROR_CHARS), code))


def control_reply(rid: str | None, kind: str, ok: bool, message: str, **extra: Any) -> bytes:
    """The reply to flush_cache, start_profile or stop_profile: `status` is the message's
    type, `success` whether it was done, `message` why not (or what was written).
    NOTE: an object, not a Reply: its extra keys differ by kind and by server."""
    head = {"rid": rid} if rid is not None else {}
    return _JSON.encode({**head, "status": kind, "success": ok, "message": message, **extra})


def stats_reply(rid: str | None, stats: dict[str, Any]) -> bytes:
    """The reply to stats: the server's figures (an open object, as `control_reply`)."""
    head = {"rid": rid} if rid is not None else {}
    return _JSON.encode({**head, "status": "stats", **stats})


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bind_server_socket(ctx: zmq.Context, host: str, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be queued raises
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    sock.setsockopt(zmq.RCVHWM, REQUEST_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    sock.bind(f"tcp://{host}:{port}")
    return sock
