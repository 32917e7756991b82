"""A small client of the prefill server (and of the decode receiver's router side)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
import zmq

from mpprefill import protocol


class Client:
    """DEALER socket speaking the JSON request protocol; one frame per message."""

    def __init__(self, address: str, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, uuid.uuid4().hex.encode())
        self.sock.connect(address if "://" in address else f"tcp://{address}")

    def send(self, obj: dict[str, Any]) -> None:
        """Any object as a frame, checked by the server only (a test's hostile frame)."""
        self.sock.send(msgspec.json.encode(obj))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def generate(
        self, rid: str, input_ids: list[int], bootstrap_room: int | None = None, **sampling
    ) -> None:
        self.send_raw(protocol.generate_frame(rid, input_ids, sampling, bootstrap_room))

    def abort(self, rid: str) -> None:
        """No reply of its own when `rid` was live: the request's reply says it was aborted."""
        self.send_raw(protocol.abort_frame(rid))

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply within {timeout}s")
        return msgspec.json.decode(self.sock.recv())

    def recv_until(self, rids: set[str], timeout: float = 60.0) -> dict[str, dict]:
        """Replies for every rid in `rids` (others are kept under their rid too)."""
        out: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while not rids <= out.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"missing replies for {sorted(rids - out.keys())[:5]}")
            reply = self.recv(left)
            out[reply.get("rid")] = reply
        return out

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server's stats; other replies arriving meanwhile are skipped."""
        rid = f"stats-{uuid.uuid4().hex[:8]}"  # echoed: an older, late stats reply is skipped
        self.send_raw(protocol.request_frame(protocol.Stats(rid)))
        deadline = time.monotonic() + timeout
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic()))
            if reply.get("status") == "stats" and reply.get("rid") in (rid, None):
                return reply

    def close(self) -> None:
        self.sock.close(linger=0)
