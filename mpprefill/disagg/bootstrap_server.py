"""The prefill's bootstrap endpoint: where decode servers register the rooms they wait for.

A decode server that gets a request with `bootstrap_host`/`bootstrap_port`/`bootstrap_room`
sends `register_room` (room, its receiver's address) to that prefill's endpoint, a ROUTER
on `--disaggregation-bootstrap-port`. It binds the prefill's `--host` (every interface only
when that is a wildcard such as 0.0.0.0), the host a router names as `bootstrap_host`. The
transfer backend's thread owns the endpoint (through RoomRegistry, room_registry.py): it
reads it with the decode links (`read`), binds a live sender of the room to the
registrant's address, or holds the registration here until the room's request arrives
(`hold`, `take`). A room whose request the prefill refused
is refused to its registrant, now or to the next one within `expiry_s` (`refuse_room`,
`take_refusal`). Registrations and remembered refusals are bounded like every other input
from a peer: frames of at most MAX_REGISTRATION_BYTES, at most `max_waiting` of them
waiting, each for at most `expiry_s`; a room already registered by another decode is
refused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

from ipc.codec import MessageError
from mpprefill.disagg import wire

logger = logging.getLogger(__name__)
MAX_FRAMES_PER_READ = 256
DEFAULT_MAX_WAITING = 4096


@dataclass(frozen=True, slots=True)
class Registration:
    room: int
    address: str  # the decode receiver the room's KV goes to
    ident: bytes  # the registrant's connection (only it may withdraw the room)
    expires: float


class BootstrapEndpoint:
    def __init__(
        self,
        ctx: zmq.Context,
        host: str,
        port: int,
        expiry_s: float,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        """Bind `host:port` (0: any free port, see `.port`)."""
        self.expiry_s = expiry_s
        self.max_waiting = max_waiting
        self.waiting: dict[int, Registration] = {}  # by room, in order of expiry
        # rooms refused before their registrant came: room -> (why, status, until), by expiry
        self.refused_rooms: dict[int, tuple[str, int | None, float]] = {}
        self.refused = 0
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REGISTRATION_BYTES)
        self.sock.setsockopt(zmq.RCVHWM, MAX_FRAMES_PER_READ)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished peer is dropped
        try:
            if port == 0:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        logger.info("bootstrap endpoint on %s:%d", host, self.port)

    def read(self) -> list[tuple[bytes, wire.RegisterRoom | wire.Abort]]:
        """The valid requests waiting on the socket; anything else is answered here."""
        out = []
        for _ in range(MAX_FRAMES_PER_READ):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._parse(frames)
            if msg is not None:
                out.append((frames[0], msg))
        return out

    def _parse(self, frames: list[bytes]) -> wire.RegisterRoom | wire.Abort | None:
        ident = frames[0]
        if len(frames) != 2:
            self.refuse(ident, None, "one JSON frame per message")
            return None
        try:
            msg = wire.decode(frames[1])
        except MessageError as e:
            self.refuse(ident, e.room, f"malformed registration: {e}")
            return None
        if not isinstance(msg, (wire.RegisterRoom, wire.Abort)):
            self.refuse(ident, getattr(msg, "room", None), f"unexpected {type(msg).__name__}")
            return None
        return msg

    def hold(self, ident: bytes, msg: wire.RegisterRoom) -> str | None:
        """Keep a registration until its room's request arrives; why not (None: held)."""
        held = self.waiting.get(msg.room)
        if held is not None:
            if held.address != msg.address:
                return f"room {msg.room} is registered by another decode"
            return None
        if len(self.waiting) >= self.max_waiting:
            return f"{len(self.waiting)} registrations already wait for their requests"
        expires = time.monotonic() + self.expiry_s
        self.waiting[msg.room] = Registration(msg.room, msg.address, ident, expires)
        return None

    def take(self, room: int) -> Registration | None:
        """The room's registration, if one waits; it no longer waits."""
        return self.waiting.pop(room, None)

    def withdraw(self, ident: bytes, room: int) -> bool:
        """Drop a waiting registration of this registrant; False if it has none."""
        held = self.waiting.get(room)
        if held is None or held.ident != ident:
            return False
        del self.waiting[room]
        return True

    def refuse_room(self, room: int, why: str, code: int | None) -> None:
        """The prefill refused the room's request (with status `code`): refuse the room to
        its waiting registrant, or to the next one within `expiry_s`."""
        reg = self.take(room)
        if reg is not None:
            self.refuse(reg.ident, room, why, code)
            return
        self.refused_rooms.pop(room, None)
        self.refused_rooms[room] = (why, code, time.monotonic() + self.expiry_s)
        while len(self.refused_rooms) > self.max_waiting:
            del self.refused_rooms[next(iter(self.refused_rooms))]

    def take_refusal(self, room: int) -> tuple[str, int | None] | None:
        """Why the room was refused and with what status, if it was; forgotten then."""
        refused = self.refused_rooms.pop(room, None)
        return None if refused is None else refused[:2]

    def expire(self, now: float) -> None:
        while self.waiting and (first := next(iter(self.waiting.values()))).expires < now:
            del self.waiting[first.room]
            logger.info("registration of room %d expired: no request for it", first.room)
        while self.refused_rooms and next(iter(self.refused_rooms.values()))[2] < now:
            del self.refused_rooms[next(iter(self.refused_rooms))]

    def accept(self, ident: bytes, room: int) -> None:
        self._send(ident, wire.RoomReply(room, True))

    def refuse(self, ident: bytes, room: int | None, why: str, code: int | None = None) -> None:
        """`code`: the status the prefill gave the room's request, when it refused it."""
        self.refused += 1
        if self.refused <= 100 or self.refused % 1000 == 0:
            logger.info("bootstrap endpoint refused room %s: %s", room, wire.brief(why))
        if room is None:
            self._send(ident, wire.ErrorReply(wire.brief(why)))
        else:
            self._send(ident, wire.RoomReply(room, False, wire.brief(why), code))

    def _send(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self.sock.send_multipart([ident, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("bootstrap reply dropped: %s", e)

    def close(self) -> None:
        self.sock.close(linger=0)
