"""When the transfer thread acts without being asked: a bootstrap sent again, a sender
failed past its transfer deadline, a link pinged, replaced or closed.

Every answer is a function of the times given (`now` and the moments a link last heard,
pinged or went idle), so what expires when is decided here and nowhere else:

    what                        due when                               then
    bootstrap, just bound       at once                                sent
    bootstrap, reply "unknown"  RETRY_S after the reply                sent again
    bootstrap, no reply         RESEND_S after it was sent             sent again
    Transferring sender         past its `transfer_by`                 failed
    link with rooms             `heartbeat_interval` after a ping      pinged
    link with rooms             silent over `dead_timeout`             its rooms fail, replaced
    link without rooms          idle over `link_idle_s`                closed

How long a sender waits for its bootstrap's answer is the sender's own deadline
(TransferSender.poll, on the scheduler thread); how long a registration waits for its
request is the bootstrap endpoint's (bootstrap_server.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mpprefill.disagg.transfer_sender import TransferSender

RETRY_S = 0.05  # after a bootstrap reply "unknown": the router has not registered yet
RESEND_S = 1.0  # a bootstrap that got no reply at all is sent again
LINK_IDLE_S = 30.0  # a link to a decode with no room in flight is closed after this


@dataclass(slots=True)
class TransferDeadlines:
    """The thread's timeouts, and when each bound room's bootstrap is due (thread only)."""

    transfer_timeout: float  # seconds from a sender's first send to its ack
    dead_timeout: float  # seconds a link with rooms may stay silent
    heartbeat_interval: float  # seconds between pings on a link with rooms
    link_idle_s: float = LINK_IDLE_S
    _next_try: dict[int, float] = field(default_factory=dict)  # room -> bootstrap due

    def ask_at_once(self, room: int) -> None:
        """The room was just bound to a link: its bootstrap goes out on the next tick."""
        self._next_try[room] = 0.0

    def ask_soon(self, room: int, now: float) -> None:
        """The receiver did not know the room yet (its router has not registered it)."""
        self._next_try[room] = now + RETRY_S

    def asked(self, room: int, now: float) -> None:
        """The room's bootstrap went out at `now`: sent again unless answered."""
        self._next_try[room] = now + RESEND_S

    def ask_due(self, room: int, now: float) -> bool:
        return now >= self._next_try[room]

    def forget(self, room: int) -> None:
        self._next_try.pop(room, None)

    def overdue(self, senders: Iterable[TransferSender], now: float) -> list[TransferSender]:
        """The senders still Transferring past their deadline, whatever the decode side says."""
        return [s for s in senders if now > s.transfer_by]

    def overdue_reason(self) -> str:
        return f"KV transfer not done within {self.transfer_timeout:.1f} s"

    def link_idle_over(self, idle_since: float, now: float) -> bool:
        """A link without rooms since `idle_since` is to be closed."""
        return now - idle_since > self.link_idle_s

    def link_silent(self, last_heard: float, now: float) -> bool:
        """A link with rooms that last heard from its receiver at `last_heard` is dead."""
        return now - last_heard > self.dead_timeout

    def ping_due(self, last_ping: float, now: float) -> bool:
        return now - last_ping >= self.heartbeat_interval
