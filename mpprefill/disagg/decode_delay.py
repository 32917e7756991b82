"""Test-only slow transfers: the decode receiver holds a finished room's answer a while.

`mpprefill decode --test-transfer-delay-ms MS --test-transfer-delay-every K` holds the
ack to the prefill and the router's reply for MS milliseconds on every room whose
bootstrap room number is a multiple of K. The prefill side sees a transfer that takes
MS longer, so aborts and failures can land while it is in flight. Off by default (MS 0).
The loop keeps serving while a room is held; an abort meanwhile ends the room as usual.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class DeliveryDelay:
    def __init__(self, delay_ms: float = 0.0, every: int = 1) -> None:
        if delay_ms < 0 or every < 1:
            raise ValueError("the transfer delay must be >= 0 ms, applied every >= 1 rooms")
        self.delay_s, self.every = delay_ms / 1000.0, every
        self._held: deque[tuple[float, Callable[[], None]]] = deque()

    def hold(self, room: int, deliver: Callable[[], None]) -> bool:
        """Queue `deliver` for later when `room` is a delayed one; False: deliver now."""
        if self.delay_s <= 0 or room % self.every:
            return False
        self._held.append((time.monotonic() + self.delay_s, deliver))
        return True

    def run_due(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            self._held.popleft()[1]()

    @property
    def pending(self) -> int:
        return len(self._held)
