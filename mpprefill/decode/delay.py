"""Test-only slow transfers: the decode receiver holds a finished room's answer a while.

A hook injected at construction (`DecodeServer(args, delay)`, `run_decode(..., delay)`),
never a flag of the shipped CLI: `TransferDelay(ms, every)` holds the ack to the prefill
and the router's reply for `ms` milliseconds on every room whose bootstrap room number is
a multiple of `every`. The prefill side sees a transfer that takes that much longer, so
aborts and failures can land while it is in flight. The loop keeps serving while a room
is held; an abort meanwhile ends the room as usual. Tests start such a decode server
through `tests/slow_decode.py`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TransferDelay:
    ms: float = 0.0
    every: int = 1

    def __post_init__(self) -> None:
        if self.ms < 0 or self.every < 1:
            raise ValueError(f"a transfer delay needs ms >= 0 and every >= 1, got {self}")

    def seconds(self, room: int) -> float:
        """How long the answer of bootstrap room `room` is held (0: not at all)."""
        if self.ms <= 0 or room % self.every:
            return 0.0
        return self.ms / 1000.0
