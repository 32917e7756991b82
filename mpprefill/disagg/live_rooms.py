"""The senders the transfer thread holds, by room, and where each room's KV goes.

A sender enters on its "start" command and stays until it is dropped: on the decode
side's final answer, on a failure, or with its abort posted. With a fixed decode address a
room is bound to that receiver's link at once; otherwise to the address a decode server
registered for it (RoomRegistry), now or later. The periodic work runs here too (`tick`):
bootstraps sent and sent again, Transferring senders past their deadline failed, links
tended (TransferDeadlines says when). Everything here runs on the transfer thread.
"""

from __future__ import annotations

from mpprefill.disagg import wire
from mpprefill.disagg.decode_links import DecodeLink, DecodeLinks
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.room_registry import RoomRegistry
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.transfer_deadlines import TransferDeadlines
from mpprefill.disagg.transfer_sender import TransferSender


class LiveRooms:
    """Live senders by room, over the links (`links`) and, without a fixed decode address,
    the registrations (`registry`)."""

    def __init__(
        self,
        links: DecodeLinks,
        registry: RoomRegistry | None,
        deadlines: TransferDeadlines,
        pages: PageWrites,
    ) -> None:
        """`registry`: None when every room goes to the fixed address `links.fixed`.
        `pages`: what each room's bootstrap says of the shipped pools."""
        self.links = links
        self.registry = registry
        self.deadlines = deadlines
        self._pages = pages
        self._live: dict[int, TransferSender] = {}

    @property
    def busy(self) -> bool:
        return bool(self._live)

    def holds(self, s: TransferSender) -> bool:
        """`s` is the live sender of its room (not dropped, not a duplicate's)."""
        return self._live.get(s.room) is s

    def on_link(self, link: DecodeLink, room: int | None) -> TransferSender | None:
        """The live sender of `room` if it is bound to `link`: a peer answers for its own
        rooms only."""
        s = self._live.get(room)
        return s if s is not None and self.links.of(room) is link else None

    def start(self, s: TransferSender) -> None:
        """Take a new sender; bind it where its room's KV goes, if that is known yet."""
        if s.room in self._live:
            s.fail(f"bootstrap room {s.room} is already in use")
            s.let_go()
            return
        self._live[s.room] = s
        if self.registry is None:
            self._bind(s, self.links.fixed)
            return
        address = self.registry.claim(s.room)
        if address is not None:
            self._bind(s, address)

    def _bind(self, s: TransferSender, address: str) -> None:
        """Send room `s.room`'s KV to the receiver at `address` from now on."""
        self.links.bind(s.room, address)
        s.registered = True
        self.deadlines.ask_at_once(s.room)

    def drop(self, s: TransferSender) -> None:
        """The thread lets go of `s`: none of its pages is read after this. A sender that
        no decode had registered yet failed: its room is refused to a late registrant."""
        if self._live.get(s.room) is s:
            del self._live[s.room]
            self.deadlines.forget(s.room)
            if self.registry is not None:
                self.registry.forget(s.room)
            link = self.links.unbind(s.room)
            if link is None and self.registry is not None:
                self.registry.refuse(s.room, s.failure_reason())
        s.let_go()

    def fail(self, s: TransferSender, reason: str) -> None:
        """Fail a sender from the thread and tell the decode side to free its room (once:
        a sender leaves the live rooms only here, on an answer, or with its abort posted)."""
        was_live = self._live.get(s.room) is s
        link = self.links.of(s.room) if was_live else None
        self.drop(s)
        if (s.fail(reason) or was_live) and link is not None:
            link.post(wire.Abort(s.room))

    def fail_all(self, reason: str) -> None:
        for s in list(self._live.values()):
            self.fail(s, reason)

    def post(self, room: int, msg: wire.Message) -> None:
        """Send `msg` to the receiver the (bound) room's KV goes to."""
        self.links.post(room, msg)

    def address_of(self, room: int) -> str:
        """The receiver the (bound) room's KV goes to."""
        return self.links.of(room).address

    # ---- registrations (without a fixed decode address) ---------------------------------

    def refuse(self, room: int, reason: str, code: int | None = None) -> None:
        """Refuse `room` to its registrant, unless a live request holds that room."""
        if room not in self._live:
            self.registry.refuse(room, reason, code)

    def read_registrations(self) -> None:
        """Registrations and withdrawals from decode servers (disagg/bootstrap_server.py)."""
        for ident, msg in self.registry.read():
            if isinstance(msg, wire.Abort):
                self._withdraw(ident, msg.room)
            else:
                self._register(ident, msg)

    def _register(self, ident: bytes, msg: wire.RegisterRoom) -> None:
        s = self._live.get(msg.room)
        link = self.links.of(msg.room)
        bound_to = None if link is None else link.address
        why, code = self.registry.check(ident, msg, s is not None, bound_to)
        if s is not None and link is None:
            self._bind(s, msg.address)
        self.registry.answer(ident, msg.room, why, code)

    def _withdraw(self, ident: bytes, room: int) -> None:
        s = self._live.get(room)
        if self.registry.withdraw(ident, room, s is not None):
            self.fail(s, "the decode side withdrew the room")

    # ---- periodic work ------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.registry is not None:
            self.registry.expire(now)
        for link in self.links.tend(now):
            self._fail_silent(link, now)
        self._expire(now)
        self._ask_again(now)

    def _fail_silent(self, link: DecodeLink, now: float) -> None:
        """Fail the rooms of a link silent past the dead timeout, then replace the link."""
        silent = now - link.last_heard
        for room in list(link.rooms):
            self.fail(self._live[room], f"decode at {link.address} silent for {silent:.1f} s")
        self.links.reconnect(link)

    def _expire(self, now: float) -> None:
        """Fail senders Transferring past their deadline, whatever the decode side says."""
        for s in self.deadlines.overdue(self._live.values(), now):
            self.fail(s, self.deadlines.overdue_reason())

    def _ask_again(self, now: float) -> None:
        """Bootstrap rooms without an answer again: the router may not have registered them
        yet, or the reply was lost. How long a sender waits is its own deadline."""
        for room, link in self.links.bound():
            if self._live[room].state == KVPoll.Bootstrapping and self.deadlines.ask_due(room, now):
                link.post(self._pages.bootstrap(room))
                self.deadlines.asked(room, now)

    def close(self) -> None:
        """Close the links and the endpoint (the thread's end)."""
        self.links.close()
        if self.registry is not None:
            self.registry.close()
