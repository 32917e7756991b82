"""The bench's router: sends each request to decode and prefill with one bootstrap room."""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import zmq

from mpprefill import protocol
from mpprefill.bench.workload import RequestSpec
from mpprefill.disagg import wire


def dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    """A DEALER to a local server; the receive queue is unbounded because a router reads
    every reply as it comes, so ZeroMQ never holds one back."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@dataclass(slots=True)
class ReqResult:
    rid: str
    prompt_tokens: int
    t_send: float
    status: str = "pending"
    cached_tokens: int = 0
    first_token: int | None = None
    error: str | None = None
    t_prefill: float | None = None  # prefill replied done (KV transfer succeeded)
    t_decode: float | None = None  # decode has every page and the first token
    t_decode_emitted: float | None = None  # the decode sent the first token (its own stamp)
    verified: bool | None = None

    @property
    def complete(self) -> bool:
        return self.status == "error" or (self.t_prefill is not None and self.t_decode is not None)

    @property
    def ttft_s(self) -> float | None:
        end = self.t_decode if self.t_decode is not None else self.t_prefill
        return None if end is None else end - self.t_send

    @property
    def ttft_decode_s(self) -> float | None:
        """From the send to the prefill to the decode's sending of the first token (as the
        decode stamped it; both stamps are this host's CLOCK_MONOTONIC)."""
        emitted = self.t_decode_emitted
        return None if emitted is None else emitted - self.t_send


class Router:
    """Open-loop sender: requests go out at their arrival times, replies are collected."""

    def __init__(
        self, prefill_port: int | None, decode_port: int | None, prefill_endpoint: str | None = None
    ):
        """The prefill server's socket on `prefill_port`, or an inproc PAIR at
        `prefill_endpoint` (the HTTP bridge, `http_bridge.py`)."""
        self.ctx = zmq.Context.instance()
        if prefill_endpoint is not None:
            self.prefill = self.ctx.socket(zmq.PAIR)
            self.prefill.setsockopt(zmq.LINGER, 0)
            self.prefill.connect(prefill_endpoint)
        else:
            self.prefill = dealer(self.ctx, prefill_port)
        self.decode = dealer(self.ctx, decode_port) if decode_port is not None else None
        self.sockets = [s for s in (self.prefill, self.decode) if s is not None]
        self.poller = zmq.Poller()
        for s in self.sockets:
            self.poller.register(s, zmq.POLLIN)

    def send_register(self, rid: str, room: int, input_ids: list[int]) -> None:
        """Tell the decode side which request will fill `room`."""
        self.decode.send(wire.encode(wire.Register(rid, room, input_ids)))

    def send_generate(self, rid: str, input_ids: list[int], room: int) -> None:
        self.prefill.send(protocol.generate_frame(rid, input_ids, bootstrap_room=room))

    def send_abort(self, rid: str) -> None:
        self.prefill.send(protocol.abort_frame(rid))

    def run(
        self,
        specs: list[RequestSpec],
        room_base: int,
        timeout: float,
        on_complete=None,
        max_concurrency: int | None = None,
    ) -> list[ReqResult]:
        """Send `specs` at their arrival times, at most `max_concurrency` unanswered at once
        (None: no limit; a request held back goes out as soon as one is answered)."""
        results = {s.rid: ReqResult(s.rid, len(s.input_ids), 0.0) for s in specs}
        rooms = {s.rid: room_base + i for i, s in enumerate(specs)}
        pending = list(specs)
        limit = max_concurrency or len(specs)
        sent = done = 0
        t0 = time.monotonic()
        deadline = t0 + timeout
        while done < len(specs):
            now = time.monotonic()
            while pending and t0 + pending[0].arrival_s <= now and sent - done < limit:
                spec = pending.pop(0)
                self._send(spec, rooms[spec.rid], results)
                sent += 1
            if now > deadline:
                raise TimeoutError(f"{len(specs) - done} requests unanswered after {timeout}s")
            wait = 50  # a reply ends the wait, and a request held by the limit waits for one
            if pending and sent - done < limit:
                wait = max(0, min(wait, int((t0 + pending[0].arrival_s - now) * 1000)))
            for sock, _ in self.poller.poll(wait):
                done += self._receive(sock, results, on_complete)
        return [results[s.rid] for s in specs]

    def _send(self, spec: RequestSpec, room: int, results: dict) -> None:
        results[spec.rid].t_send = time.monotonic()
        if self.decode is not None:
            self.send_register(spec.rid, room, spec.input_ids)
        self.send_generate(spec.rid, spec.input_ids, room)

    def _receive(self, sock, results: dict, on_complete) -> int:
        finished = 0
        while True:
            try:
                reply = msgspec.json.decode(sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return finished
            r = results.get(reply.get("rid"))
            if r is None or r.complete:
                continue
            self._apply(r, reply, from_decode=sock is self.decode)
            if r.complete:
                finished += 1
                if on_complete is not None:
                    on_complete(r)

    def _apply(self, r: ReqResult, reply: dict, from_decode: bool) -> None:
        now = time.monotonic()
        if reply.get("status") != "done":
            r.status = "error"
            r.error = reply.get("error", "unknown error")
            return
        if from_decode:
            r.t_decode = now
            r.t_decode_emitted = reply.get("emitted_at")
            r.verified = reply.get("verified")
        else:
            r.t_prefill = now
            r.cached_tokens = reply.get("cached_tokens", 0)
            r.first_token = reply.get("first_token")
            if self.decode is None:
                r.t_decode = now
        if r.complete:
            r.status = "done"

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
