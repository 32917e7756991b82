"""Which decode server registered each room, as the transfer thread answers registrations.

The bootstrap endpoint (bootstrap_server.py) holds the registrations that came before
their request, and the refusals that came before their registration. This registry adds
what the thread alone knows: whether the room has a live sender and where it is bound. It
answers each registration and withdrawal from those facts, and remembers the registrant of
every room it bound, since only that connection may withdraw the room. It never binds or
fails a sender itself: it says so, and the caller (LiveRooms) does it.
"""

from __future__ import annotations

from mpprefill.disagg import wire
from mpprefill.disagg.bootstrap_server import BootstrapEndpoint


class RoomRegistry:
    """The registrants of live rooms, over the endpoint's waiting registrations."""

    def __init__(self, endpoint: BootstrapEndpoint) -> None:
        self.endpoint = endpoint
        self._registrant: dict[int, bytes] = {}  # room -> who registered it

    def read(self) -> list[tuple[bytes, wire.RegisterRoom | wire.Abort]]:
        """Registrations and withdrawals waiting on the endpoint."""
        return self.endpoint.read()

    def claim(self, room: int) -> str | None:
        """Where a registration that waited for `room`'s request sends its KV (None: none
        waited); its registrant now owns the room."""
        reg = self.endpoint.take(room)
        if reg is None:
            return None
        self._registrant[room] = reg.ident
        return reg.address

    def check(
        self, ident: bytes, msg: wire.RegisterRoom, live: bool, bound_to: str | None
    ) -> tuple[str | None, int | None]:
        """Why registration `msg` is refused and with what status ((None, None): accepted).
        `live`: the room has a live sender; `bound_to`: the address it is bound to. A live,
        unbound room is the registrant's from now on: the caller binds it to `msg.address`.
        Without a live sender the registration waits for its request (`hold`), unless the
        request was refused already."""
        refused = self.endpoint.take_refusal(msg.room)
        if not live and refused is not None:
            return refused
        if not live:
            return self.endpoint.hold(ident, msg), None
        if bound_to is None:
            self._registrant[msg.room] = ident
            return None, None
        return (None if bound_to == msg.address else f"room {msg.room} is bound elsewhere"), None

    def answer(self, ident: bytes, room: int, why: str | None, code: int | None) -> None:
        """Reply to a registration as `check` decided."""
        if why is None:
            self.endpoint.accept(ident, room)
        else:
            self.endpoint.refuse(ident, room, why, code)

    def withdraw(self, ident: bytes, room: int, live: bool) -> bool:
        """The registrant `ident` gives `room` up (its request ended on the decode side).
        True: the room's live sender is to fail; otherwise a waiting registration of this
        peer is dropped, or the peer is told the room is not its own."""
        if live and self._registrant.get(room) == ident:
            return True
        if not self.endpoint.withdraw(ident, room):
            self.endpoint.refuse(ident, room, f"room {room} is not registered by this peer")
        return False

    def refuse(self, room: int, reason: str, code: int | None = None) -> None:
        """Refuse `room` to its registrant: the one waiting now, or the next one within the
        registrations' expiry."""
        why = f"the prefill refused the request: {wire.brief(reason)}"
        self.endpoint.refuse_room(room, why, code)

    def forget(self, room: int) -> None:
        """The room's sender is dropped: its registrant no longer owns it."""
        self._registrant.pop(room, None)

    def expire(self, now: float) -> None:
        self.endpoint.expire(now)

    def close(self) -> None:
        self.endpoint.close()
