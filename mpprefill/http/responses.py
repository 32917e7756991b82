"""What the front's routes share to answer: orjson bodies, bounded JSON reads, a client
gone before its reply, server-sent events and the error event of a failed stream."""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from mpprefill.http.errors import HttpError, bad_request, error_body

logger = logging.getLogger(__name__)
BIG_BODY_BYTES = 1 << 20  # bodies parsed on a thread, so the event loop keeps serving
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class FastJSONResponse(JSONResponse):
    """Bodies through orjson: 3x faster to parse and 15x to write than the standard
    library's for /generate's bodies (scripts/bench_http_json.py)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ClientGone(Exception):
    """The HTTP client disconnected before its reply; its requests were aborted."""


async def read_json(request: Request, limit: int, empty: Any = None) -> Any:
    """The body as JSON (`empty` for no body, where given); 413 for a body over `limit`
    bytes (`limit` itself is allowed), 400 if not JSON.

    NOTE: the size is checked before any parsing: a Content-Length over the limit is
    refused unread, and a body without one (chunked) as soon as its bytes pass the limit.
    The bytes gather in one buffer, so a refused body leaves no chunks behind."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise HttpError(413, f"a body of {length} bytes is over the limit of {limit}")
    data = bytearray()
    async for chunk in request.stream():
        if len(data) + len(chunk) > limit:
            raise HttpError(413, f"the body is over the limit of {limit} bytes")
        data += chunk
    if not data and empty is not None:
        return empty
    try:
        if len(data) > BIG_BODY_BYTES:
            return await asyncio.to_thread(orjson.loads, data)
        return orjson.loads(data)
    except (ValueError, RecursionError):  # orjson.JSONDecodeError is a ValueError
        raise bad_request("the body is not JSON (or nests too deeply)") from None


def free_big_buffers_to_the_os() -> None:
    """Have the C allocator map every block over BIG_BODY_BYTES on its own, so a body's
    buffer goes back to the OS when freed, refused or not (no-op off glibc).

    NOTE: glibc otherwise raises its mmap threshold to the largest block freed (up to 32
    MiB): after one big body, the next ones come from the heap and their pages stay with
    the process. Fixing the threshold also fixes the heap's trim threshold (128 KiB)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, BIG_BODY_BYTES)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result; cancelled (ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(e: Exception) -> dict[str, Any]:
    if isinstance(e, HttpError):
        return e.body()
    logger.error("a streamed request failed", exc_info=e)
    return error_body(500, f"internal error: {type(e).__name__}")
