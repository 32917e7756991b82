"""The decode server's side of bootstrap: register rooms at the prefills' endpoints.

A request names its prefill by `bootstrap_host:bootstrap_port`; `register` sends that
prefill's endpoint (disagg/bootstrap_server.py) the room and this decode's receiver address, over
one DEALER per prefill, made on demand. `withdraw` gives a room up when its request ended
before the KV came. Replies (`room_reply`) come back from `read`: a refusal ends the room.
A link whose prefill hangs up (its process died: a restarted one knows none of the rooms)
refuses every room still waiting there. A link with no room waiting is closed after
IDLE_S, and at most MAX_LINKS are open: a request naming one more prefill than that is
refused.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.codec import MessageError
from mpprefill.disagg import wire

logger = logging.getLogger(__name__)
MAX_LINKS = 256
IDLE_S = 60.0
_MAX_REPLY_BYTES = 4096
HUNG_UP = "the prefill endpoint hung up (its process ended) before the KV came"


class PrefillLinks:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, own_address: str) -> None:
        """`own_address`: this decode's receiver, host:port, as prefills are to reach it;
        the links' sockets join `poller` (the server's loop)."""
        self.ctx = ctx
        self.poller = poller
        self.own_address = own_address
        self._socks: dict[str, zmq.Socket] = {}  # by prefill endpoint address
        self._rooms: dict[str, set[int]] = {}  # endpoint -> rooms registered there
        self._monitors: dict[str, zmq.Socket] = {}  # endpoint -> its link's disconnect events
        self._idle_since: dict[str, float] = {}

    def register(self, endpoint: str, room: int) -> str | None:
        """Register `room` at the prefill endpoint `endpoint`; why not (None: sent)."""
        sock = self._socks.get(endpoint)
        if sock is None:
            if len(self._socks) >= MAX_LINKS:
                return f"links to {len(self._socks)} prefills are open already"
            sock = self._connect(endpoint)
        self._rooms[endpoint].add(room)
        self._post(sock, wire.RegisterRoom(room, self.own_address))
        return None

    def withdraw(self, endpoint: str, room: int) -> None:
        """Give up `room` at `endpoint` (its request ended on this side)."""
        if room in self._rooms.get(endpoint, ()):
            self.done(endpoint, room)
            self._post(self._socks[endpoint], wire.Abort(room))

    def done(self, endpoint: str, room: int) -> None:
        """`room` no longer waits on `endpoint` (its KV came, or it ended)."""
        rooms = self._rooms.get(endpoint)
        if rooms is not None and room in rooms:
            rooms.discard(room)
            if not rooms:
                self._idle_since[endpoint] = time.monotonic()

    def read(self, events: dict) -> list[tuple[str, wire.RoomReply]]:
        """(endpoint, reply) for each refusal or acceptance waiting on a link that `events`
        (the server's poll) marks readable; what is not a reply about one of the link's
        rooms is logged and dropped."""
        out = []
        for endpoint, sock in list(self._socks.items()):
            if self._monitors[endpoint] in events and self._hung_up(endpoint):
                out += [
                    (endpoint, wire.RoomReply(r, False, HUNG_UP)) for r in self._rooms[endpoint]
                ]
            if sock not in events:
                continue
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = self._parse(endpoint, frame)
                if reply is not None:
                    out.append((endpoint, reply))
        return out

    def _hung_up(self, endpoint: str) -> bool:
        """Whether the link's monitor saw the prefill close the connection."""
        hung_up = False
        while True:
            try:
                event = recv_monitor_message(self._monitors[endpoint], zmq.NOBLOCK)
            except zmq.Again:
                return hung_up
            hung_up = hung_up or event["event"] == zmq.EVENT_DISCONNECTED

    def _parse(self, endpoint: str, frame: bytes) -> wire.RoomReply | None:
        try:
            msg = wire.decode(frame)
        except MessageError as e:
            logger.warning("bad frame from the prefill endpoint %s: %s", endpoint, e)
            return None
        if isinstance(msg, wire.RoomReply) and msg.room in self._rooms[endpoint]:
            return msg
        if isinstance(msg, wire.ErrorReply):
            logger.warning("prefill endpoint %s: %s", endpoint, wire.brief(msg.error))
        return None

    def close_idle(self, now: float) -> None:
        for endpoint, since in list(self._idle_since.items()):
            if not self._rooms[endpoint] and now - since > IDLE_S:
                self._close(endpoint)

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._close(endpoint)

    def _connect(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://{endpoint}")
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self._monitors[endpoint] = monitor
        self._socks[endpoint] = sock
        self._rooms[endpoint] = set()
        return sock

    def _close(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint)
        monitor = self._monitors.pop(endpoint)
        self.poller.unregister(sock)
        self.poller.unregister(monitor)
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        del self._rooms[endpoint]
        self._idle_since.pop(endpoint, None)

    @staticmethod
    def _post(sock: zmq.Socket, msg: wire.Message) -> None:
        try:
            sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("prefill endpoint link full: dropped %s", type(msg).__name__)
