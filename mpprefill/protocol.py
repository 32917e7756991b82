"""The client <-> prefill server request protocol: one JSON object per frame."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mpprefill.sampling import SamplingParams

MAX_FRAME_BYTES = 4 << 20


class ProtocolError(ValueError):
    """A frame the server will not act on; `rid` is set when one could be read."""

    def __init__(self, message: str, rid: str | None = None):
        super().__init__(message)
        self.rid = rid


@dataclass(frozen=True, slots=True)
class Generate:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    bootstrap_room: int | None


@dataclass(frozen=True, slots=True)
class Abort:
    rid: str


@dataclass(frozen=True, slots=True)
class Stats:
    pass


def parse_frame(frame: bytes) -> Generate | Abort | Stats:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        obj = json.loads(frame)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError("frame is not JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    rid = obj.get("rid") if isinstance(obj.get("rid"), str) else None
    kind = obj.get("type")
    parser = {"generate": _generate, "abort": _abort, "stats": lambda o, r: Stats()}.get(kind)
    if parser is None:
        raise ProtocolError(f"unknown message type {kind!r}", rid)
    return parser(obj, rid)


def _generate(obj: dict[str, Any], rid: str | None) -> Generate:
    if not rid:
        raise ProtocolError("generate needs a non-empty string rid")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ProtocolError("input_ids must be a list of integers", rid)
    room = obj.get("bootstrap_room")
    if room is not None and (type(room) is not int or room < 0):
        raise ProtocolError("bootstrap_room must be a non-negative integer", rid)
    try:
        params = SamplingParams.from_dict(obj.get("sampling_params"))
    except ValueError as e:
        raise ProtocolError(f"sampling_params: {e}", rid) from None
    unknown = set(obj) - {"type", "rid", "input_ids", "sampling_params", "bootstrap_room"}
    if unknown:
        raise ProtocolError(f"unknown fields {sorted(unknown)}", rid)
    return Generate(rid, ids, params, room)


def _abort(obj: dict[str, Any], rid: str | None) -> Abort:
    if not rid:
        raise ProtocolError("abort needs a string rid")
    return Abort(rid)


def done_reply(rid: str, first_token: int, prompt_tokens: int, cached_tokens: int) -> bytes:
    return _dump(
        {
            "rid": rid,
            "status": "done",
            "first_token": first_token,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
        }
    )


def error_reply(rid: str | None, error: str) -> bytes:
    return _dump({"rid": rid, "status": "error", "error": error})


def _dump(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
