"""The chaos run's router: sends to decode and prefill with one room, files every reply."""

from __future__ import annotations

import json
import time
from collections import Counter

import zmq
from chaos_load import Hostile, Record


def _dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # the router reads everything; never drop a reply here
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


class Router:
    def __init__(self, prefill_port: int, decode_port: int):
        self.ctx = zmq.Context()
        self.prefill_port = prefill_port
        self.prefill = _dealer(self.ctx, prefill_port)
        self.decode = _dealer(self.ctx, decode_port)
        self.hostile = _dealer(self.ctx, prefill_port)
        self.poller = zmq.Poller()
        for sock in (self.prefill, self.decode, self.hostile):
            self.poller.register(sock, zmq.POLLIN)
        self.records: dict[str, Record] = {}
        self.hostiles: dict[str, Hostile] = {}
        self.hostile_sent: list[Hostile] = []
        self.null_rid_replies = 0
        self.stray: list[dict] = []
        self.counts: Counter = Counter()
        self.outstanding = 0
        self._throwaway: list[tuple[float, zmq.Socket]] = []

    # ---- sending -------------------------------------------------------------------------

    def send(self, rec: Record) -> None:
        self.records[rec.rid] = rec
        rec.t_send, rec.outstanding_at_send = time.monotonic(), self.outstanding
        if rec.kind != "toolong" and rec.register_after <= 0:
            self.register(rec)
        msg = {"type": "generate", "rid": rec.rid, "input_ids": rec.prompt}
        msg |= {"bootstrap_room": rec.room, "sampling_params": {"temperature": 0.0}}
        self.prefill.send(json.dumps(msg).encode())
        self.outstanding += 1
        self.counts["sent"] += 1

    def register(self, rec: Record) -> None:
        if rec.replies:  # the prefill already answered: the room would never be used
            return
        rec.registered = True
        msg = {"type": "register", "rid": rec.rid, "bootstrap_room": rec.room}
        self.decode.send(json.dumps(msg | {"input_ids": rec.prompt}).encode())

    def abort(self, rec: Record) -> bool:
        if rec.replies:
            return False
        rec.t_abort = time.monotonic()
        self.prefill.send(json.dumps({"type": "abort", "rid": rec.rid}).encode())
        return True

    def send_hostile(self, h: Hostile) -> None:
        self.hostile_sent.append(h)
        if h.rid is not None:
            self.hostiles[h.rid] = h
        if h.expect == "none":  # ZeroMQ drops it with the connection: use a socket of its own
            sock = _dealer(self.ctx, self.prefill_port)
            sock.send_multipart(h.frames)
            self._throwaway.append((time.monotonic() + 2.0, sock))
        else:
            self.hostile.send_multipart(h.frames)

    # ---- receiving -----------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            handle = {
                self.prefill: self._on_prefill,
                self.decode: self._on_decode,
                self.hostile: self._on_hostile,
            }[sock]
            for _ in range(1000):
                try:
                    handle(json.loads(sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        now = time.monotonic()
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
        for sock in (self.prefill, self.decode, self.hostile):
            sock.close(linger=0)
        self.ctx.term()
