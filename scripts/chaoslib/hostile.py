"""Malformed and hostile frames for the chaos run, each with the answer the server owes it.

They are written by hand rather than with `mpprefill.protocol`'s builders: most of them are
frames no builder would make. Hostile clients send them too: rids of a megabyte (the reply
carries the first MAX_RID_CHARS), frames of several MiB, and aborts of requests that another
client owns (refused as "unknown rid"; the request runs on, which the error check sees).
"""

from __future__ import annotations

import json
import random
from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from chaoslib.workload import Record
from mpprefill import protocol

HUGE_RID_CHARS = 1 << 20
ONCE = ("deep-nesting", "oversize", "oversize-mib", "beyond-wire-limit")  # big: sent once


@dataclass(slots=True)
class Hostile:
    """One malformed or hostile message; `rid` is what the server can read, if anything."""

    kind: str
    frames: list[bytes]
    rid: str | None
    expect: str = "error"  # error | stats | none (dropped by ZeroMQ with the connection)
    replies: list[dict] = field(default_factory=list)


def hostile_frames(rng: random.Random, n: int) -> list[Hostile]:
    """`n` hostile messages of every kind, oversize ones rare; rids `bad<i>`."""
    kinds = list(_BUILDERS)
    repeated = [k for k in kinds if k not in ONCE]
    out = []
    for i in range(n):
        kind = kinds[i] if i < len(kinds) else rng.choice(repeated)
        out.append(_BUILDERS[kind](f"bad{i}", rng))
    rng.shuffle(out)
    return out


def foreign_abort(
    rng: random.Random, records: Iterable[Record], taken: Container[str]
) -> Hostile | None:
    """An abort, from the hostile client, of a request it does not own: one of the socket's
    still unanswered, with no abort of its own planned (so an abort that wrongly lands
    stays unexplained) and not aimed at before (`taken`)."""
    victims = [r.rid for r in records if not r.replies and r.abort_stage is None and r.via == "zmq"]
    victims = [rid for rid in victims if rid not in taken]
    if not victims:
        return None
    rid = rng.choice(victims)
    return Hostile("abort-foreign", [_json(_abort(rid))], rid)


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _gen(rid, **kw) -> dict:
    return {"type": "generate", "rid": rid, "input_ids": [1, 2, 3], **kw}


def _nested(rid: str, rng) -> Hostile:
    deep = b"[" * 100_000 + b"]" * 100_000
    head = b'{"type": "generate", "rid": "' + rid.encode() + b'", "input_ids": '
    return Hostile("deep-nesting", [head + deep + b"}"], rid)


def _oversize(
    rid: str, rng, size: int = protocol.MAX_FRAME_BYTES, kind: str = "oversize"
) -> Hostile:
    head = b'{"rid": "' + rid.encode() + b'", "type": "generate", "input_ids": ['
    body = b"1, " * ((size - len(head)) // 3 + 10) + b"1]}"
    return Hostile(kind, [head + body], rid)


def _beyond_wire(rid: str, rng) -> Hostile:
    return Hostile("beyond-wire-limit", [b" " * (protocol.MAX_WIRE_BYTES + 1)], None, "none")


_BUILDERS = {
    "not-json": lambda rid, rng: Hostile("not-json", [bytes(rng.randbytes(40))], None),
    "empty": lambda rid, rng: Hostile("empty", [b""], None),
    "array": lambda rid, rng: Hostile("array", [b"[1, 2, 3]"], None),
    "type-list": lambda rid, rng: Hostile("type-list", [_json({"type": ["x"], "rid": rid})], rid),
    "ids-string": lambda rid, rng: Hostile("ids-string", [_json(_gen(rid, input_ids="ab"))], rid),
    "ids-bool": lambda rid, rng: Hostile("ids-bool", [_json(_gen(rid, input_ids=[1, True]))], rid),
    "ids-float": lambda rid, rng: Hostile("ids-float", [_json(_gen(rid, input_ids=[1.5]))], rid),
    "ids-empty": lambda rid, rng: Hostile("ids-empty", [_json(_gen(rid, input_ids=[]))], rid),
    "huge-token": lambda rid, rng: Hostile(
        "huge-token", [_json(_gen(rid, input_ids=[2**70]))], rid
    ),
    "huge-room": lambda rid, rng: Hostile(
        "huge-room", [_json(_gen(rid, bootstrap_room=2**80))], rid
    ),
    "negative-room": lambda rid, rng: Hostile(
        "negative-room", [_json(_gen(rid, bootstrap_room=-1))], rid
    ),
    "huge-rid": lambda rid, rng: _huge_rid(rid, "huge-rid", _gen),
    "huge-rid-bad-field": lambda rid, rng: _huge_rid(rid, "huge-rid-bad-field", _gen, x=1),
    "abort-huge-rid": lambda rid, rng: _huge_rid(rid, "abort-huge-rid", _abort),
    "rid-int": lambda rid, rng: Hostile("rid-int", [_json(_gen(12345))], None),
    "bad-sampling": lambda rid, rng: Hostile(
        "bad-sampling", [_json(_gen(rid, sampling_params={"top_p": "x"}))], rid
    ),
    "nan-temperature": lambda rid, rng: Hostile(
        "nan-temperature", [_json(_gen(rid, sampling_params={"temperature": float("nan")}))], rid
    ),
    "unknown-field": lambda rid, rng: Hostile("unknown-field", [_json(_gen(rid, x=1))], rid),
    "unknown-type": lambda rid, rng: Hostile(
        "unknown-type", [_json({"type": "x", "rid": rid})], rid
    ),
    "abort-unknown": lambda rid, rng: Hostile("abort-unknown", [_json(_abort(rid))], rid),
    "multipart": lambda rid, rng: Hostile("multipart", [_json(_gen(rid)), b"extra"], rid),
    "stats-rid": lambda rid, rng: Hostile(
        "stats-rid", [_json({"type": "stats", "rid": rid})], rid, "stats"
    ),
    "deep-nesting": _nested,
    "oversize": _oversize,
    "oversize-mib": lambda rid, rng: _oversize(rid, rng, 10 << 20, "oversize-mib"),
    "beyond-wire-limit": _beyond_wire,
}


def _abort(rid) -> dict:
    return {"type": "abort", "rid": rid}


def _huge_rid(rid: str, kind: str, make, **kw) -> Hostile:
    long = rid + "x" * HUGE_RID_CHARS
    return Hostile(kind, [_json(make(long, **kw))], long[: protocol.MAX_RID_CHARS])
