"""The chaos run's router: the bench router's sockets and frames, plus a socket for hostile
frames and one to the prefill's bootstrap endpoint; files every reply under its request.

A room is registered as a decode server registers it: at the decode receiver (which
allocates its pages) and at the prefill's bootstrap endpoint, naming that receiver. The
router leg's requests (`track`, `answer`) are counted and filed here too."""

from __future__ import annotations

import json
import time
from collections import Counter

import zmq

from chaoslib.hostile import Hostile
from chaoslib.workload import Record
from mpprefill.bench.router import Router, dealer

THROWAWAY_S = 2.0  # how long a socket of its own keeps a frame ZeroMQ will drop


class ChaosRouter(Router):
    def __init__(self, prefill_port: int, decode_port: int, bootstrap_port: int):
        super().__init__(prefill_port, decode_port)
        self.prefill_port = prefill_port
        self.decode_address = f"127.0.0.1:{decode_port}"
        self.hostile = dealer(self.ctx, prefill_port)
        self.endpoint = dealer(self.ctx, bootstrap_port)
        for sock in (self.hostile, self.endpoint):
            self.poller.register(sock, zmq.POLLIN)
        self.records: dict[str, Record] = {}
        self.by_room: dict[int, Record] = {}
        self._routed: dict[str, Record] = {}  # the router leg's requests in flight
        self.room_refusals: list[tuple[int, str]] = []  # (room, why) the endpoint refused
        self.hostiles: dict[str, Hostile] = {}
        self.hostile_sent: list[Hostile] = []
        self.null_rid_replies = 0
        self.stray: list[dict] = []
        self.counts: Counter = Counter()
        self.outstanding = 0
        self._throwaway: list[tuple[float, zmq.Socket]] = []

    # ---- sending -------------------------------------------------------------------------

    def track(self, rec: Record) -> None:
        """A request sent, by this socket or through the router leg."""
        self.records[rec.rid] = rec
        rec.t_send = time.monotonic()
        rec.outstanding_at_send = self.outstanding
        self.outstanding += 1
        self.counts["sent"] += 1
        if rec.via == "router":
            self._routed[rec.rid] = rec
        for r in self._routed.values():
            r.outstanding_peak = max(r.outstanding_peak, self.outstanding - 1)

    def send(self, rec: Record) -> None:
        self.track(rec)
        self.by_room[rec.room] = rec
        if rec.kind != "toolong" and rec.register_after <= 0:
            self.register(rec)
        self.send_generate(rec.rid, rec.prompt, rec.room)

    def register(self, rec: Record) -> None:
        if rec.replies:  # the prefill already answered: the room would never be used
            return
        rec.registered = True
        self.send_register(rec.rid, rec.room, rec.prompt)
        msg = {"type": "register_room", "room": rec.room, "address": self.decode_address}
        self.endpoint.send(json.dumps(msg).encode())

    def answer(self, rec: Record, reply: dict) -> None:
        """The router leg's answer to `rec`."""
        self._routed.pop(rec.rid, None)
        rec.replies.append(reply)
        if len(rec.replies) == 1:
            self._answered(rec, reply)

    def abort(self, rec: Record) -> bool:
        if rec.replies:
            return False
        rec.t_abort = time.monotonic()
        self.send_abort(rec.rid)
        return True

    def send_hostile(self, h: Hostile) -> None:
        self.hostile_sent.append(h)
        if h.rid is not None:
            self.hostiles[h.rid] = h
        if h.expect == "none":  # ZeroMQ drops it with the connection: use a socket of its own
            sock = dealer(self.ctx, self.prefill_port)
            sock.send_multipart(h.frames)
            self._throwaway.append((time.monotonic() + THROWAWAY_S, sock))
        else:
            self.hostile.send_multipart(h.frames)

    # ---- receiving -----------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> None:
        handlers = {
            self.prefill: self._on_prefill,
            self.decode: self._on_decode,
            self.hostile: self._on_hostile,
            self.endpoint: self._on_endpoint,
        }
        for sock, _ in self.poller.poll(timeout_ms):
            _drain(sock, handlers[sock])
        self._close_throwaways(time.monotonic())

    def _close_throwaways(self, now: float) -> None:
        for t, sock in [x for x in self._throwaway if x[0] < now]:
            sock.close(linger=0)
            self._throwaway.remove((t, sock))

    def _on_prefill(self, reply: dict) -> None:
        rec = self.records.get(reply.get("rid"))
        if rec is None:
            self.stray.append(reply)
        elif rec.t_abort is not None and reply.get("error") == "unknown rid":
            rec.unknown_abort_replies += 1  # our abort came after its answer
        else:
            rec.replies.append(reply)
            if len(rec.replies) == 1:
                self._answered(rec, reply)

    def _answered(self, rec: Record, reply: dict) -> None:
        rec.t_reply = time.monotonic()
        self.outstanding -= 1
        self.counts[reply.get("status", "?")] += 1
        if reply.get("status") != "done" and rec.registered and not rec.decode_replies:
            self.decode.send(json.dumps({"type": "abort", "room": rec.room}).encode())

    def _on_decode(self, reply: dict) -> None:
        rec = self.records.get(reply.get("rid"))
        if rec is not None:
            rec.decode_replies.append(reply)
        elif reply.get("type") == "error":  # e.g. our abort of a room that already ended
            self.counts["decode_room_errors"] += 1
        else:
            self.stray.append({"from": "decode", **reply})

    def _on_endpoint(self, reply: dict) -> None:
        if reply.get("type") == "room_reply" and reply.get("ok") is True:
            self.counts["rooms_registered"] += 1
        elif reply.get("type") == "room_reply":
            self.room_refusals.append((reply.get("room"), reply.get("error") or ""))
        else:
            self.stray.append({"from": "endpoint", **reply})

    def _on_hostile(self, reply: dict) -> None:
        rid = reply.get("rid")
        if rid is None:
            self.null_rid_replies += 1
        elif rid in self.hostiles:
            self.hostiles[rid].replies.append(reply)
        else:
            self.stray.append({"from": "hostile", **reply})

    def close(self) -> None:
        for _, sock in self._throwaway:
            sock.close(linger=0)
        self.hostile.close(linger=0)
        self.endpoint.close(linger=0)
        super().close()


def _drain(sock: zmq.Socket, handle, limit: int = 1000) -> None:
    """Hand up to `limit` waiting replies to `handle`, so one busy socket cannot starve the
    others."""
    for _ in range(limit):
        try:
            handle(json.loads(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return
