"""The bench through the HTTP front: a thread that turns the router's generate and abort
frames into `POST /generate` and `/abort_request`, and the front's answers back into the
protocol's replies, so `Router.run` drives either front unchanged.

The router's prefill socket is one end of an inproc PAIR; this thread holds the other,
and an asyncio loop with one connection per request (`Connection: close`), so every
request of an open-loop workload is in flight at once, as on the ZeroMQ socket.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import zmq
import zmq.asyncio

CONNECT_TIMEOUT_S = 30.0


class HttpBridge:
    """`endpoint` is the inproc address the router's prefill socket connects to."""

    def __init__(self, ctx: zmq.Context, http_port: int, timeout_s: float):
        self.ctx = ctx
        self.port = http_port
        self.timeout_s = timeout_s
        self.endpoint = f"inproc://http-bridge-{uuid.uuid4().hex}"
        self._bound = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="http-bridge", daemon=True)
        self._thread.start()
        if not self._bound.wait(CONNECT_TIMEOUT_S):
            raise RuntimeError("the HTTP bridge did not start")

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        actx = zmq.asyncio.Context.shadow(self.ctx)
        sock = actx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._bound.set()
        tasks: set[asyncio.Task] = set()
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                recv = asyncio.ensure_future(sock.recv())
                await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    recv.cancel()
                    break
                task = asyncio.ensure_future(self._forward(sock, json.loads(recv.result())))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sock.close(linger=0)

    async def _forward(self, sock, msg: dict[str, Any]) -> None:
        if msg["type"] == "abort":
            await self._post("/abort_request", {"rid": msg["rid"]})
            return
        body = {
            "rid": msg["rid"],
            "input_ids": msg["input_ids"],
            "sampling_params": {**msg.get("sampling_params", {}), "max_new_tokens": 1},
        }
        if msg.get("bootstrap_room") is not None:
            body["bootstrap_room"] = msg["bootstrap_room"]
        try:
            status, out = await self._post("/generate", body)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            status, out = 0, {"error": {"message": f"HTTP request failed: {e!r}"}}
        await sock.send(json.dumps(as_reply(msg["rid"], status, out)).encode())

    async def _post(self, path: str, body: dict) -> tuple[int, Any]:
        return await asyncio.wait_for(http_post("127.0.0.1", self.port, path, body), self.timeout_s)

    def close(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def as_reply(rid: str, status: int, out: Any) -> dict[str, Any]:
    """The protocol's reply for the front's answer to one prompt."""
    if status == 200 and out.get("output_ids"):
        meta = out["meta_info"]
        return {
            "rid": rid,
            "status": "done",
            "first_token": out["output_ids"][0],
            "prompt_tokens": meta["prompt_tokens"],
            "cached_tokens": meta["cached_tokens"],
        }
    error = out.get("error", {}).get("message") if isinstance(out, dict) else None
    return {"rid": rid, "status": "error", "error": f"HTTP {status}: {error or out}"}


async def http_post(host: str, port: int, path: str, body: dict) -> tuple[int, Any]:
    """One HTTP/1.1 POST of a JSON body on a connection of its own: (status, JSON reply)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode() + data)
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload) if payload else None
