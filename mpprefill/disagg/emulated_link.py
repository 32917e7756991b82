"""The network link between a prefill and its decodes, emulated (`--emulate-link-gbps`).

The link is one serialized wire of `gbps` with a fixed per-message `latency_us`. A message
of B bytes handed to it at time t leaves once the wire is free and is delivered `latency`
after its last bit:

    start     = max(t, free_at)
    free_at   = start + B * 8 / (gbps * 1e9)        the next message waits for this
    delivered = free_at + latency                    latencies of messages overlap

    t=0   A (1 MB)  |===A===|~~lat~~>                 A delivered at 8e6 / G + lat
    t=0   B (1 MB)          |===B===|~~lat~~>         B queued behind A's bytes
    t=big C                                 |=C=|~~lat~~>   the wire was idle: starts at t

Every figure is a function of the times handed in, so tests drive it with an explicit
clock. The link only does arithmetic; holding what is not due yet is TransferLink's job
(transfer_link.py).
"""

from __future__ import annotations

import math


class EmulatedLink:
    """One serialized wire: bandwidth queues messages, latency does not."""

    def __init__(self, gbps: float, latency_us: float) -> None:
        if not (gbps > 0 and math.isfinite(gbps)):
            raise ValueError(f"link bandwidth must be a positive number of Gb/s, got {gbps}")
        if not (latency_us >= 0 and math.isfinite(latency_us)):
            raise ValueError(f"link latency must be >= 0 us, got {latency_us}")
        self.gbps = gbps
        self.latency_s = latency_us * 1e-6
        self.free_at = -math.inf  # when the last bit handed so far has left
        self.bytes_carried = 0

    def wire_s(self, nbytes: int) -> float:
        """Seconds `nbytes` occupy the wire."""
        return nbytes * 8 / (self.gbps * 1e9)

    def carry(self, nbytes: int, now: float) -> float:
        """Hand a message of `nbytes` to the link at `now`; the time it is delivered."""
        if nbytes < 0:
            raise ValueError(f"a message of {nbytes} bytes")
        start = max(now, self.free_at)
        self.free_at = start + self.wire_s(nbytes)
        self.bytes_carried += nbytes
        return self.free_at + self.latency_s
