"""The chaos run's workload: requests with their planned faults, and hostile frames."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from mpprefill import protocol

VOCAB = 4096
SLOW_EVERY = 1000  # rooms that are multiples of this are held by the decode side
ABORT_STAGES = ("waiting", "bootstrapping", "mid-chunk", "transfer")


@dataclass(slots=True)
class Record:
    """One generate request and everything that happened to it."""

    rid: str
    prompt: list[int]
    room: int
    kind: str  # normal | long | slow | burst | toolong | final
    abort_stage: str | None = None  # the stage an abort was aimed at
    abort_after: float = 0.0  # seconds after the send
    register_after: float = 0.0  # decode registration delayed this long
    t_send: float | None = None
    t_abort: float | None = None
    t_reply: float | None = None
    outstanding_at_send: int = 0
    replies: list[dict] = field(default_factory=list)  # prefill answers to the generate
    unknown_abort_replies: int = 0  # "unknown rid" answers to our abort (it raced the end)
    decode_replies: list[dict] = field(default_factory=list)
    registered: bool = False


@dataclass(slots=True)
class Hostile:
    """One malformed or hostile message; `rid` is what the server can read, if anything."""

    kind: str
    frames: list[bytes]
    rid: str | None
    expect: str = "error"  # error | stats | none (dropped by ZeroMQ with the connection)
    replies: list[dict] = field(default_factory=list)


class Workload:
    """Seeded prompts sharing system prefixes, so the prefix cache and eviction both work."""

    def __init__(self, seed: int, pool_tokens: int):
        self.rng = random.Random(seed)
        self.pool_tokens = pool_tokens
        self.systems = [self._ids(self.rng.randrange(32, 160)) for _ in range(12)]
        self._n = 0
        self._room = 0
        self._slow_room = 0

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB) for _ in range(n)]

    def _next_room(self, slow: bool) -> int:
        if slow:
            self._slow_room += SLOW_EVERY
            return self._slow_room
        self._room += 1
        if self._room % SLOW_EVERY == 0:
            self._room += 1
        return self._room

    def request(self, kind: str = "normal", abort_p: float = 0.0, slow_p: float = 0.0) -> Record:
        self._n += 1
        if kind == "toolong":
            prompt = self._ids(self.pool_tokens + self.rng.randrange(16, 200))
        elif kind == "final":
            prompt = self._ids(self.rng.randrange(200, 320))
        else:
            long = self.rng.random() < 0.15
            kind = "long" if long and kind == "normal" else kind
            system = self.rng.choice(self.systems)
            prompt = system + self._ids(
                self.rng.randrange(200, 480) if long else self.rng.randrange(4, 64)
            )
        slow = kind in ("normal", "long") and self.rng.random() < slow_p
        rec = Record(f"c{self._n}", prompt, self._next_room(slow), "slow" if slow else kind)
        boost = {"slow": 5.0, "long": 3.0}.get(rec.kind, 1.0)  # rarer kinds, same abort count
        if kind not in ("toolong", "final") and self.rng.random() < abort_p * boost:
            self._plan_abort(rec)
        return rec

    def _plan_abort(self, rec: Record) -> None:
        """Aim an abort at a stage; the timing makes that stage the likely one."""
        if rec.kind == "burst":
            rec.abort_stage, rec.abort_after = "waiting", self.rng.uniform(0.0, 0.05)
        elif rec.kind == "slow":
            rec.abort_stage, rec.abort_after = "transfer", self.rng.uniform(0.5, 1.0)
        elif rec.kind == "long":
            rec.abort_stage, rec.abort_after = "mid-chunk", self.rng.uniform(0.02, 0.25)
        else:
            rec.abort_stage, rec.abort_after = "bootstrapping", self.rng.uniform(0.02, 0.15)
            rec.register_after = rec.abort_after + 0.3  # the decode side hears of it late


def hostile_frames(rng: random.Random, n: int) -> list[Hostile]:
    """`n` hostile messages of every kind, oversize ones rare; rids `bad<i>`."""
    kinds = list(_BUILDERS)
    out = []
    for i in range(n):
        kind = kinds[i] if i < len(kinds) else rng.choice(kinds[:-3])  # the big ones once
        out.append(_BUILDERS[kind](f"bad{i}", rng))
    rng.shuffle(out)
    return out


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _gen(rid, **kw) -> dict:
    return {"type": "generate", "rid": rid, "input_ids": [1, 2, 3], **kw}


def _nested(rid: str, rng) -> Hostile:
    deep = b"[" * 100_000 + b"]" * 100_000
    head = b'{"type": "generate", "rid": "' + rid.encode() + b'", "input_ids": '
    return Hostile("deep-nesting", [head + deep + b"}"], rid)


def _oversize(rid: str, rng) -> Hostile:
    head = b'{"rid": "' + rid.encode() + b'", "type": "generate", "input_ids": ['
    body = b"1, " * ((protocol.MAX_FRAME_BYTES - len(head)) // 3 + 10) + b"1]}"
    return Hostile("oversize", [head + body], rid)


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
    "huge-rid": lambda rid, rng: _huge_rid(rid),
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
    "abort-unknown": lambda rid, rng: Hostile(
        "abort-unknown", [_json({"type": "abort", "rid": rid})], rid
    ),
    "multipart": lambda rid, rng: Hostile("multipart", [_json(_gen(rid)), b"extra"], rid),
    "stats-rid": lambda rid, rng: Hostile(
        "stats-rid", [_json({"type": "stats", "rid": rid})], rid, "stats"
    ),
    "deep-nesting": _nested,
    "oversize": _oversize,
    "beyond-wire-limit": _beyond_wire,
}


def _huge_rid(rid: str) -> Hostile:
    long = rid + "x" * 10_000
    return Hostile("huge-rid", [_json(_gen(long))], long)
