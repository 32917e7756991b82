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

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.token_logprob import TokenLogprob

MAX_FRAME_BYTES = 4 << 20
MAX_WIRE_BYTES = 64 << 20
MAX_RID_CHARS = 256
MAX_ERROR_CHARS = 1024
MAX_ROOM = 2**63 - 1
MAX_HOST_CHARS = 255  # bootstrap rooms are int64 on every transfer backend
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


class ProtocolError(ValueError):
    """A frame the server will not act on; `rid` is set when one could be read."""

    def __init__(self, message: str, rid: str | None = None, code: int = Code.BAD_REQUEST):
        super().__init__(message)
        self.rid = rid
        self.code = code


@dataclass(frozen=True, slots=True)
class Generate:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    bootstrap_room: int | None
    # Where the prefill that computes this room's KV serves its bootstrap endpoint (a decode
    # side's request; the prefill side ignores them, as SGLang's does).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    stream: bool = False  # the decode side sends "partial" replies as tokens come


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


@dataclass(frozen=True, slots=True)
class Stats:
    rid: str | None = None  # echoed in the reply when given


@dataclass(frozen=True, slots=True)
class FlushCache:
    """Drop the prefix cache, only while no request is live (SGLang's /flush_cache)."""

    rid: str | None = None


@dataclass(frozen=True, slots=True)
class StartProfile:
    """Trace the scheduler and forward processes into `output_dir` until StopProfile, or
    for `num_steps` forwards when given; `activities` (SGLang's) run torch's profiler in
    the forward's process too (none: spans only)."""

    rid: str | None
    output_dir: str
    num_steps: int | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")


@dataclass(frozen=True, slots=True)
class StopProfile:
    rid: str | None = None


PROFILE_ACTIVITIES = ("CPU", "GPU", "MEM")  # SGLang's torch profiler activities
MAX_PATH_CHARS = 4096


def parse_frame(frame: bytes | memoryview) -> Generate | Abort | Stats:
    """Parse one frame; ProtocolError (with the rid when readable) for anything unusable."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes",
            sniff_rid(bytes(frame[:SNIFF_BYTES])),
            Code.TOO_LARGE,
        )
    try:
        obj = json.loads(bytes(frame))
    except (UnicodeDecodeError, ValueError, RecursionError):
        head = bytes(frame[:SNIFF_BYTES])
        raise ProtocolError("frame is not JSON (or nests too deeply)", sniff_rid(head)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    rid = obj.get("rid") if isinstance(obj.get("rid"), str) else None
    kind = obj.get("type")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise ProtocolError(f"unknown message type {_short(kind)}", rid)
    if rid is not None and len(rid) > MAX_RID_CHARS:
        raise ProtocolError(f"rid longer than {MAX_RID_CHARS} characters", rid)
    return parser(obj, rid)


def sniff_rid(head: bytes) -> str | None:
    """The rid of a frame too large to parse, when its head shows it unambiguously."""
    m = _HEAD_RID.match(head)
    if m is None:
        return None
    try:
        rid = json.loads(m.group(1))
    except (UnicodeDecodeError, ValueError):
        return None
    return rid if isinstance(rid, str) and rid else None


def bootstrap_error(room: Any, host: Any, port: Any) -> str | None:
    """Why these bootstrap fields (None: not given) are not ones a server takes, or None."""
    if room is not None and (type(room) is not int or not 0 <= room <= MAX_ROOM):
        return "bootstrap_room must be an integer in [0, 2**63)"
    if host is not None and (not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS):
        return f"bootstrap_host must be a string of 1 to {MAX_HOST_CHARS} characters"
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        return "bootstrap_port must be an integer in [1, 65535]"
    return None


def _generate(obj: dict[str, Any], rid: str | None) -> Generate:
    if not rid:
        raise ProtocolError("generate needs a non-empty string rid")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ProtocolError("input_ids must be a list of integers", rid)
    room = obj.get("bootstrap_room")
    host = obj.get("bootstrap_host")
    port = obj.get("bootstrap_port")
    why = bootstrap_error(room, host, port)
    if why is not None:
        raise ProtocolError(why, rid)
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError("stream must be a boolean", rid)
    try:
        params = SamplingParams.from_dict(obj.get("sampling_params"))
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"sampling_params: {e}", rid) from None
    unknown = set(obj) - _GENERATE_FIELDS
    if unknown:
        raise ProtocolError(f"unknown fields {_short(sorted(unknown))}", rid)
    return Generate(rid, ids, params, room, host, port, stream)


def _abort(obj: dict[str, Any], rid: str | None) -> Abort:
    if not rid:
        raise ProtocolError("abort needs a string rid")
    return Abort(rid)


def _start_profile(obj: dict[str, Any], rid: str | None) -> StartProfile:
    out = obj.get("output_dir")
    if not isinstance(out, str) or not 0 < len(out) <= MAX_PATH_CHARS:
        raise ProtocolError("start_profile needs an output_dir string", rid)
    steps = obj.get("num_steps")
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ProtocolError("num_steps must be a positive integer or null", rid)
    acts = obj.get("activities")
    acts = ["CPU", "GPU"] if acts is None else acts
    if not isinstance(acts, list) or not all(a in PROFILE_ACTIVITIES for a in acts):
        raise ProtocolError(f"activities must be a list of {PROFILE_ACTIVITIES}", rid)
    return StartProfile(rid, out, steps, tuple(acts))


# A generate frame holds its type and Generate's fields, under their names.
_GENERATE_FIELDS = frozenset(("type", *(f.name for f in dataclasses.fields(Generate))))
_PARSERS = {
    "generate": _generate,
    "abort": _abort,
    "stats": lambda o, rid: Stats(rid),
    "flush_cache": lambda o, rid: FlushCache(rid),
    "start_profile": _start_profile,
    "stop_profile": lambda o, rid: StopProfile(rid),
}


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
    `bootstrap_*` or `stream` key when none is given."""
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
    return _dump(msg)


def abort_frame(rid: str) -> bytes:
    return _dump({"type": "abort", "rid": rid})


def _short(value: Any, limit: int = 80) -> str:
    """repr() for an error message, cut so a hostile value cannot bloat the reply."""
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    return _dump(
        {
            "rid": rid,
            "status": "done",
            "first_token": first_token,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "output_ids": output_ids,
            "completion_tokens": len(output_ids),
            "finish_reason": finish_reason,
            **_logprob_fields(logprobs, top_logprobs),
        }
    )


def partial_reply(
    rid: str,
    output_ids: list[int],
    logprobs: Sequence[TokenLogprob] | None = None,
    top_logprobs: bool = False,
) -> bytes:
    """A streamed request's tokens generated since its previous reply; its last reply is a
    done (or error) reply, which repeats every token. Logprobs as in `done_reply`, of these
    tokens."""
    reply = {"rid": rid, "status": "partial", "output_ids": output_ids}
    return _dump({**reply, **_logprob_fields(logprobs, top_logprobs)})


def _logprob_fields(logprobs: Sequence[TokenLogprob] | None, top: bool) -> dict[str, Any]:
    """`output_token_logprobs` (a float per token; null where unknown) and, with `top`,
    `output_top_logprobs` (per token a list of [token_id, logprob] pairs, best first)."""
    if logprobs is None:
        return {}
    out: dict[str, Any] = {"output_token_logprobs": [t.logprob for t in logprobs]}
    if top:
        out["output_top_logprobs"] = [t.top for t in logprobs]
    return out


def error_reply(rid: str | None, error: str, code: int | None = None) -> bytes:
    """NOTE: the rid and the reason are cut, so a reply stays small whatever was sent.
    Without a `code` the reply has none (a client then reads the status from the reason)."""
    rid = rid[:MAX_RID_CHARS] if rid is not None else None
    out = {"rid": rid, "status": "error", "error": _cut(error, MAX_ERROR_CHARS)}
    if code is not None:
        out["code"] = code
    return _dump(out)


def control_reply(rid: str | None, kind: str, ok: bool, message: str, **extra: Any) -> bytes:
    """The reply to flush_cache, start_profile or stop_profile: `status` is the message's
    type, `success` whether it was done, `message` why not (or what was written)."""
    head = {"rid": rid} if rid is not None else {}
    return _dump({**head, "status": kind, "success": ok, "message": message, **extra})


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def bind_server_socket(ctx: zmq.Context, host: str, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply that cannot be queued raises
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    sock.setsockopt(zmq.RCVHWM, REQUEST_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_BYTES)
    sock.bind(f"tcp://{host}:{port}")
    return sock
