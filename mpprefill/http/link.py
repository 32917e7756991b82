"""The front's one DEALER to the scheduler, shared by every HTTP request in flight.

A reader task takes each reply off the socket and hands it to the request waiting on its
rid; requests send their frames and await their own queue, so any number are in flight at
once. The server answers every generate with one final reply (done or error), before which
a streamed request may get `partial` replies (a generating decode side sends them); a stats
or control request that carries a rid echoes it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from mpprefill import protocol
from mpprefill.protocol import UNKNOWN_RID, Code

logger = logging.getLogger(__name__)


class NoReply(Exception):
    """The scheduler did not answer within the request's deadline."""


class RidInFlight(ValueError):
    """A request whose rid another request in flight here holds."""


class FrameTooLarge(Exception):
    """A request whose frame the scheduler would refuse unread (protocol.MAX_FRAME_BYTES)."""


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """Where the prefill that fills a request's KV serves its bootstrap, and the room."""

    room: int | None = None
    host: str | None = None
    port: int | None = None


class SchedulerLink:
    def __init__(self, address: str):
        self.address = address if "://" in address else f"tcp://{address}"
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"http-{uuid.uuid4().hex}".encode())
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_WIRE_BYTES)
        # NOTE: frames wait in the front while the scheduler is unreachable, and a request
        # that times out there is never delivered later to a scheduler that comes back.
        self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self.sock.connect(self.address)
        self._waiting: dict[str, asyncio.Queue] = {}
        self._controls: set[str] = set()  # the rids in _waiting that are not generates
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        """Run the reader; call from the event loop that serves the requests."""
        self._reader = asyncio.get_running_loop().create_task(self._read_replies())

    def in_flight(self, rid: str) -> bool:
        return rid in self._waiting

    def rids(self) -> list[str]:
        """The generate requests in flight."""
        return [rid for rid in self._waiting if rid not in self._controls]

    async def generate(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        bootstrap: Bootstrap | None,
        timeout: float,
        on_partial: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The server's final reply (done or error). With `on_partial`, the request is sent
        as streamed and each partial reply before it goes to `on_partial`. A request
        cancelled or timed out here is aborted there."""
        bootstrap = bootstrap or Bootstrap()
        frame = protocol.generate_frame(
            rid,
            input_ids,
            sampling_params,
            bootstrap.room,
            bootstrap.host,
            bootstrap.port,
            stream=on_partial is not None,
        )
        if len(frame) > protocol.MAX_FRAME_BYTES:
            limit = protocol.MAX_FRAME_BYTES
            raise FrameTooLarge(f"a request of {len(frame)} bytes is over the limit of {limit}")
        try:
            return await self._request(rid, frame, timeout, on_partial)
        except (asyncio.CancelledError, NoReply):
            await self.abort(rid)
            raise

    async def stats(self, timeout: float) -> dict[str, Any]:
        return await self.control("stats", timeout)

    async def control(self, kind: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """One request of `kind` (stats, flush_cache, start_profile, ...) and its reply."""
        rid = f"{kind}-{uuid.uuid4().hex}"
        frame = protocol.request_frame(protocol.CONTROLS[kind](rid=rid, **fields))
        self._controls.add(rid)
        try:
            return await self._request(rid, frame, timeout)
        finally:
            self._controls.discard(rid)

    async def abort(self, rid: str) -> None:
        """No reply of its own: the request's reply says it was aborted. Never waits: an
        abort that cannot be queued has no scheduler to reach."""
        try:
            await self.sock.send(protocol.abort_frame(rid), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not send the abort of %.64r: the scheduler is unreachable", rid)

    async def _request(
        self, rid: str, frame: bytes, timeout: float, on_partial=None
    ) -> dict[str, Any]:
        if rid in self._waiting:
            raise RidInFlight(f"rid {rid[:64]!r} is already in flight")
        replies: asyncio.Queue = asyncio.Queue()
        self._waiting[rid] = replies
        try:
            return await asyncio.wait_for(self._send_and_wait(frame, replies, on_partial), timeout)
        except asyncio.TimeoutError:
            raise NoReply(f"no reply from the scheduler within {timeout:g} s") from None
        finally:
            if self._waiting.get(rid) is replies:
                del self._waiting[rid]

    async def _send_and_wait(self, frame: bytes, replies: asyncio.Queue, on_partial) -> dict:
        await self.sock.send(frame)
        while True:
            reply = await replies.get()
            if reply.get("status") != "partial":
                return reply
            if on_partial is not None:
                on_partial(reply)

    async def _read_replies(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                reply = msgspec.json.decode(frame)
            except ValueError:
                logger.warning("unreadable reply from the scheduler (%d bytes)", len(frame))
                continue
            self._route(reply)

    def _route(self, reply: Any) -> None:
        if not isinstance(reply, dict):
            logger.warning("a reply from the scheduler that is not an object")
            return
        rid = reply.get("rid")
        if reply.get("status") == "error" and (
            reply.get("code") == Code.UNKNOWN_RID or reply.get("error") == UNKNOWN_RID
        ):
            return  # the answer to an abort that came after its request's reply
        replies = self._waiting.get(rid) if isinstance(rid, str) else None
        if replies is None:
            logger.debug("a reply for no request in flight (rid %.64r)", rid)
            return
        if reply.get("status") != "partial":  # the final reply: the rid is free again
            del self._waiting[rid]
        replies.put_nowait(reply)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        closing = {"status": "error", "error": "the HTTP front is closing", "code": 503}
        for replies in self._waiting.values():
            replies.put_nowait(closing)
        self._waiting.clear()
        self.sock.close(linger=0)
        self.ctx.term()
