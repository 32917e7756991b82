"""What decode receivers say on the links, applied to the rooms it names (transfer thread).

A message concerns a live sender only if its room is bound to the link it came on: a
message about another link's room is ignored. A frame that does not decode, or a message
that cannot be used, fails its room only, never the thread. An ack counts only after the
room's last send and from the receiver's run (`instance`) that answered its bootstrap. A
bootstrap reply that gives a room its pages is handed back to the caller, the backend,
which opens the decode pool it names (`TransferBackend._attach`) and readies the sender.
"""

from __future__ import annotations

import logging
import time

from ipc.codec import MessageError
from mpprefill.disagg import wire
from mpprefill.disagg.decode_links import DecodeLink
from mpprefill.disagg.live_rooms import LiveRooms
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.transfer_deadlines import TransferDeadlines
from mpprefill.disagg.transfer_sender import TransferSender

logger = logging.getLogger(__name__)

Ready = tuple[TransferSender, wire.BootstrapReply]  # a sender and the reply that readies it


class DecodeReplies:
    """Reads each frame from a decode link into the live rooms."""

    def __init__(self, rooms: LiveRooms, deadlines: TransferDeadlines) -> None:
        self.rooms = rooms
        self.deadlines = deadlines

    def on_frame(self, link: DecodeLink, frame: bytes) -> Ready | None:
        """Apply one frame from `link`; a bootstrap reply that readies its sender comes back."""
        try:
            msg = wire.decode(frame)
        except MessageError as e:
            logger.warning("bad frame from the decode at %s: %s", link.address, e)
            s = self.rooms.on_link(link, e.room)
            if s is not None:
                self.rooms.fail(s, f"bad frame from the decode side: {e}")
            return None
        s = self.rooms.on_link(link, getattr(msg, "room", None))
        try:
            return self._on_message(link, s, msg)
        except Exception as e:  # a peer's message fails its room, never this thread
            why = wire.brief(f"{type(e).__name__}: {e}")
            logger.warning("unusable %s from the decode side: %s", type(msg).__name__, why)
            if s is not None:
                self.rooms.fail(s, f"unusable {type(msg).__name__}: {why}")
            return None

    def _on_message(
        self, link: DecodeLink, s: TransferSender | None, msg: wire.Message
    ) -> Ready | None:
        """`s`: the live sender of the message's room bound to this link, if any."""
        if isinstance(msg, wire.BootstrapReply) and s is not None:
            return self._on_bootstrap_reply(s, msg)
        if isinstance(msg, wire.Ack) and s is not None:
            self._on_ack(s, msg)
        elif isinstance(msg, wire.Abort):
            if s is not None:
                self.rooms.drop(s)
                s.fail("aborted by the decode side")
            link.post(wire.Abort(msg.room))  # confirms: nothing more is written for the room
        elif isinstance(msg, wire.ErrorReply) and s is not None:
            self.rooms.fail(s, f"decode side error: {wire.brief(msg.error)}")
        elif isinstance(msg, wire.ErrorReply) and msg.room is None:
            logger.warning("decode side error: %s", wire.brief(msg.error))
        return None

    def _on_ack(self, s: TransferSender, msg: wire.Ack) -> None:
        """Only the receiver run that answered the bootstrap acks, and only after the last
        send: another run never saw the room's pages."""
        if not s.awaiting_ack or msg.instance != s.instance:
            why = "before the last send" if not s.awaiting_ack else "from another decode run"
            self.rooms.fail(s, f"ack {why} (instance {wire.quote(msg.instance)})")
        elif msg.ok:
            self.rooms.drop(s)
            s.succeed()
        else:
            self.rooms.drop(s)
            s.fail(f"decode side refused: {wire.brief(msg.error or '')}")

    def _on_bootstrap_reply(self, s: TransferSender, msg: wire.BootstrapReply) -> Ready | None:
        if msg.status == "unknown":
            self.deadlines.ask_soon(s.room, time.monotonic())
        elif msg.status == "error":
            self.rooms.fail(s, f"bootstrap refused: {wire.brief(msg.error or '')}")
        elif s.state == KVPoll.Bootstrapping:
            return s, msg
        return None
