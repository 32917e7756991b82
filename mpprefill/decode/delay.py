"""Test-only slow transfers: the decode receiver holds a finished room's answer a while.

`mpprefill decode --test-transfer-delay-ms MS --test-transfer-delay-every K` holds the
ack to the prefill and the router's reply for MS milliseconds on every room whose
bootstrap room number is a multiple of K. The prefill side sees a transfer that takes
MS longer, so aborts and failures can land while it is in flight. Off by default (MS 0).
The loop keeps serving while a room is held; an abort meanwhile ends the room as usual.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TransferDelay:
    ms: float = 0.0
    every: int = 1

    def __post_init__(self) -> None:
        if self.ms < 0 or self.every < 1:
            raise ValueError(
                "--test-transfer-delay-ms must be >= 0 and --test-transfer-delay-every >= 1"
            )

    def seconds(self, room: int) -> float:
        """How long the answer of bootstrap room `room` is held (0: not at all)."""
        if self.ms <= 0 or room % self.every:
            return 0.0
        return self.ms / 1000.0
