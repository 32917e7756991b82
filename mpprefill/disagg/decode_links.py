"""The transfer thread's links to decode receivers: one DEALER per decode address, and
which room is bound to which.

A link is made when a room first needs it and closed once idle (unless it is the one fixed
`decode_address`), pinged while it has rooms, and handed back to the caller when silent
past the dead timeout, to fail its rooms and `reconnect` it; TransferDeadlines says when.
Everything here runs on the transfer thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import ItemsView

import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.transfer_deadlines import TransferDeadlines

logger = logging.getLogger(__name__)


class DecodeLink:
    """The DEALER to one decode receiver, and its liveness."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.rooms: set[int] = set()  # live senders bound to this link
        self.last_heard = self.last_ping = self.idle_since = time.monotonic()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self.sock.connect(f"tcp://{address}")

    def post(self, msg: wire.Message) -> None:
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("decode socket %s full; dropped %s", self.address, type(msg).__name__)

    def recv(self) -> bytes | None:
        """The next frame from the receiver (None: none waits); it counts as a sign of life."""
        try:
            frame = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        self.last_heard = time.monotonic()
        return frame


class DecodeLinks:
    """The links by decode address, each registered with the thread's `poller`, and the
    link each bound room's KV goes over."""

    def __init__(
        self,
        ctx: zmq.Context,
        poller: zmq.Poller,
        deadlines: TransferDeadlines,
        fixed: str | None = None,
    ) -> None:
        """`fixed`: the one `decode_address` every room goes to, whose link stays open."""
        self.fixed = fixed
        self.deadlines = deadlines
        self._ctx = ctx
        self._poller = poller
        self._links: dict[str, DecodeLink] = {}  # by decode address
        self._link_of: dict[int, DecodeLink] = {}  # room -> the link its sender is bound to

    def link(self, address: str) -> DecodeLink:
        """The link to the receiver at `address`, made on first use."""
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = DecodeLink(self._ctx, address)
            self._poller.register(link.sock, zmq.POLLIN)
        return link

    def bind(self, room: int, address: str) -> None:
        """Send `room`'s KV to the receiver at `address` from now on."""
        link = self.link(address)
        if not link.rooms:
            link.last_heard = time.monotonic()  # silence while idle does not count
        link.rooms.add(room)
        self._link_of[room] = link

    def unbind(self, room: int) -> DecodeLink | None:
        """The link `room` was bound to, if any; the room leaves it."""
        link = self._link_of.pop(room, None)
        if link is not None:
            link.rooms.discard(room)
            link.idle_since = time.monotonic()
        return link

    def of(self, room: int) -> DecodeLink | None:
        return self._link_of.get(room)

    def bound(self) -> ItemsView[int, DecodeLink]:
        """(room, link) of every bound room."""
        return self._link_of.items()

    def post(self, room: int, msg: wire.Message) -> None:
        """Send `msg` over the link of `room`, which is bound."""
        self._link_of[room].post(msg)

    def readable(self, events: dict) -> list[DecodeLink]:
        """The links with frames waiting, by the thread's poll `events`."""
        return [link for link in self._links.values() if link.sock in events]

    def tend(self, now: float) -> list[DecodeLink]:
        """Ping each busy link, close each idle one; the links silent past the dead timeout,
        whose rooms are the caller's to fail before it reconnects them."""
        silent = []
        for link in list(self._links.values()):
            if not link.rooms:
                if self._idle_over(link, now):
                    self._unlink(link)
            elif self.deadlines.link_silent(link.last_heard, now):
                silent.append(link)
            elif self.deadlines.ping_due(link.last_ping, now):
                link.post(wire.Ping())
                link.last_ping = now
        return silent

    def _idle_over(self, link: DecodeLink, now: float) -> bool:
        """An idle link to close: any but the fixed decode's, idle long enough."""
        return link.address != self.fixed and self.deadlines.link_idle_over(link.idle_since, now)

    def reconnect(self, link: DecodeLink) -> None:
        """A fresh DEALER to the same address, in place of `link` (which has no rooms).

        NOTE: ZeroMQ closes a link that brings a frame over MAXMSGSIZE and never
        reconnects it; a link that stays silent is replaced instead.
        """
        self._unlink(link)
        self.link(link.address)

    def _unlink(self, link: DecodeLink) -> None:
        self._poller.unregister(link.sock)
        link.sock.close(linger=0)
        del self._links[link.address]

    def close(self) -> None:
        """Close every link, letting what was posted last go out briefly (thread's end)."""
        for link in self._links.values():
            link.sock.close(linger=200)
