"""The request socket both servers serve: one ROUTER speaking the request protocol.

It reads what clients sent, a bounded amount per call, and hands the server each parsed
request with its client's identity; a frame it cannot parse is answered here with its error
reply (to its rid where one can be read) and counted. Replies go out without blocking: one
that cannot be queued (the client is gone or not reading) is dropped and counted, and its
request was released before, so the server's memory stays flat (see protocol.py for the
socket's limits).
"""

from __future__ import annotations

import logging

import zmq

import mpprefill.protocol as protocol
from ipc.codec import MessageError

logger = logging.getLogger(__name__)
DROP_LOG_EVERY = 1000  # past the first few, one log line per this many drops or bad frames


class RequestSocket:
    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self.sock = protocol.bind_server_socket(ctx, host, port)
        self.replies_dropped = 0
        self.bad_frames = 0

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the system's pick for port 0)."""
        return int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def read(
        self, max_frames: int, max_bytes: int = protocol.MAX_FRAME_BYTES
    ) -> tuple[int, list[tuple[bytes, protocol.AnyRequest]]]:
        """(frames read, the requests among them with their clients), until the socket is
        empty or `max_frames` or `max_bytes` are read (one frame may cross `max_bytes`)."""
        got: list[tuple[bytes, protocol.AnyRequest]] = []
        nbytes = 0
        for n in range(max_frames):
            if nbytes >= max_bytes:
                return n, got
            try:
                parts = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n, got
            nbytes += sum(len(p) for p in parts[1:])
            ident = parts[0].bytes
            msg = self._parse(ident, parts[1:])
            if msg is not None:
                got.append((ident, msg))
        return max_frames, got

    def _parse(self, ident: bytes, frames: list[zmq.Frame]) -> protocol.AnyRequest | None:
        if len(frames) != 1:
            head = bytes(frames[0].buffer[: protocol.SNIFF_BYTES]) if frames else b""
            self.refuse(ident, protocol.sniff_rid(head), f"{len(frames)} frames, one expected")
            return None
        frame = frames[0]
        data = frame.bytes if len(frame) <= protocol.MAX_FRAME_BYTES else frame.buffer
        try:
            return protocol.parse_frame(data)
        except MessageError as e:
            self.refuse(ident, e.rid, str(e), e.code or protocol.Code.BAD_REQUEST)
            return None

    def refuse(
        self, ident: bytes, rid: str | None, why: str, code: int = protocol.Code.BAD_REQUEST
    ) -> None:
        """A bad frame's error reply; logged, though past the first 100 only one in
        DROP_LOG_EVERY."""
        self.bad_frames += 1
        if self.bad_frames <= 100 or self.bad_frames % DROP_LOG_EVERY == 0:
            logger.info("bad frame (%d so far): %s", self.bad_frames, why)
        self.send(ident, protocol.error_reply(rid, why, code))

    def send(self, ident: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart([ident, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone (EHOSTUNREACH) or not reading (EAGAIN)
            self.replies_dropped += 1
            if self.replies_dropped % DROP_LOG_EVERY == 1:
                n = self.replies_dropped
                logger.warning("dropped a reply to a client (%s); %d so far", e.strerror, n)

    def counters(self) -> dict[str, int]:
        return {"replies_dropped": self.replies_dropped, "bad_frames": self.bad_frames}

    def close(self, linger_ms: int = 1000) -> None:
        self.sock.close(linger=linger_ms)
