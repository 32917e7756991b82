"""The chaos run's requests: seeded prompts, bootstrap rooms, and the fault planned for each.

Not `mpprefill.bench.workload`: that one makes prompts of fixed shape to hit a cache rate;
here every request draws its own kind and length, and a room and an abort with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mpprefill.bench.workload import DEFAULT_VOCAB

SLOW_EVERY = 1000  # rooms that are multiples of this are held by the decode side
MAX_NEW_TOKENS = 8  # a router request generates 1 to this many tokens


@dataclass(slots=True)
class Record:
    """One generate request and everything that happened to it."""

    rid: str
    prompt: list[int]
    room: int
    kind: str  # normal | long | slow | burst | toolong | final | router
    abort_stage: str | None = None  # waiting | bootstrapping | mid-chunk | transfer
    abort_after: float = 0.0  # seconds after the send
    register_after: float = 0.0  # decode registration delayed this long
    t_send: float | None = None
    t_abort: float | None = None
    t_reply: float | None = None
    outstanding_at_send: int = 0
    # router: the most outstanding while in flight (it reaches the prefill after its send)
    outstanding_peak: int = 0
    replies: list[dict] = field(default_factory=list)  # prefill answers to the generate
    unknown_abort_replies: int = 0  # "unknown rid" answers to our abort (it raced the end)
    decode_replies: list[dict] = field(default_factory=list)
    registered: bool = False
    via: str = "zmq"  # zmq: the socket, registered by hand | router: SGLang's router
    max_new_tokens: int = 1  # router: the decode server generates this many
    stream: bool = False  # router: answered as server-sent events


class ChaosWorkload:
    """Seeded prompts sharing system prefixes, so the prefix cache and eviction both work."""

    def __init__(self, seed: int, pool_tokens: int):
        self.rng = random.Random(seed)
        self.pool_tokens = pool_tokens
        self.systems = [self._ids(self.rng.randrange(32, 160)) for _ in range(12)]
        self._n = 0
        self._room = 0
        self._slow_room = 0

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1, DEFAULT_VOCAB) for _ in range(n)]

    def _next_room(self, slow: bool) -> int:
        if slow:
            self._slow_room += SLOW_EVERY
            return self._slow_room
        self._room += 1
        if self._room % SLOW_EVERY == 0:
            self._room += 1
        return self._room

    def request(
        self, kind: str = "normal", abort_p: float = 0.0, slow_p: float = 0.0, router_p: float = 0.0
    ) -> Record:
        self._n += 1
        if kind in ("normal", "burst") and self.rng.random() < router_p:
            return self._routed()
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

    def _routed(self) -> Record:
        """A request through SGLang's router: the router picks its room, the generating
        decode server answers; no fault of its own (but in a burst, the full queue's)."""
        prompt = self.rng.choice(self.systems) + self._ids(self.rng.randrange(4, 64))
        rec = Record(f"c{self._n}", prompt, -1, "router", via="router")
        rec.max_new_tokens = self.rng.randint(1, MAX_NEW_TOKENS)
        rec.stream = self.rng.random() < 0.5
        return rec

    def _plan_abort(self, rec: Record) -> None:
        """Aim an abort at a stage; the timing makes that stage the likely one."""
        if rec.kind == "burst":
            rec.abort_stage = "waiting"
            rec.abort_after = self.rng.uniform(0.0, 0.05)
        elif rec.kind == "slow":
            rec.abort_stage = "transfer"
            rec.abort_after = self.rng.uniform(0.5, 1.0)
        elif rec.kind == "long":
            rec.abort_stage = "mid-chunk"
            rec.abort_after = self.rng.uniform(0.02, 0.25)
        else:
            rec.abort_stage = "bootstrapping"
            rec.abort_after = self.rng.uniform(0.02, 0.15)
            rec.register_after = rec.abort_after + 0.3  # the decode side hears of it late
