"""A hostile peer at the decode address, for the chaos run.

While the real receiver is down for its restart, this binds its port (as any local user
could) and answers the prefill's transfer backend: every bootstrap gets a reply the prefill
must refuse (bad handles, segments that are not a decode pool's, the prefill's own KV pool
or staging, pages beyond int64, no instance), and it sends acks and ready replies for rooms
it never got. The prefill must fail those rooms and nothing else: `problems` names every
room the prefill called done on this peer's word alone.

Frames are written by hand: most of them are frames no well-behaved receiver would send.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter

import zmq

import ipc
from ipc.shm import SHM_DIR
from mpprefill.bench.router import dealer

LEARN_ROOM = 2**40  # the room it registers at the real receiver to see its pool
INSTANCE = "hostile-decode"
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class HostileDecode:
    def __init__(self, port: int, seed: int, worker_pid: int | None):
        self.port = port
        self.rng = random.Random(seed)
        self.worker_pid = worker_pid
        self.pool: dict | None = None  # the real receiver's pool description
        self.counts: Counter = Counter()  # kinds of replies sent
        self.touched: set[int] = set()  # rooms it answered for

    # ---- before the real receiver goes down ---------------------------------------------

    def learn(self, timeout: float = 5.0) -> None:
        """Register a room at the real receiver and bootstrap it, to copy its pool's shape."""
        ctx = zmq.Context()
        sock = dealer(ctx, self.port)
        try:
            reg = {"type": "register", "rid": "hostile-learn", "bootstrap_room": LEARN_ROOM}
            sock.send(json.dumps({**reg, "input_ids": [1]}).encode())
            sock.send(json.dumps({"type": "bootstrap", "room": LEARN_ROOM}).encode())
            if sock.poll(int(timeout * 1000)):
                reply = json.loads(sock.recv())
                self.pool = reply.get("pool") if reply.get("status") == "ready" else None
            sock.send(json.dumps({"type": "abort", "room": LEARN_ROOM}).encode())
            sock.poll(int(timeout * 1000))
        finally:
            sock.close(linger=0)
            ctx.term()

    # ---- while it is down ------------------------------------------------------------------

    def serve(self, seconds: float) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://127.0.0.1:{self.port}")
        except zmq.ZMQError:
            self.counts["hostile-decode/port-taken"] += 1
            sock.close()
            ctx.term()
            return
        end = time.monotonic() + seconds
        try:
            while (left := end - time.monotonic()) > 0:
                if sock.poll(max(1, int(left * 1000))):
                    ident, frame = sock.recv_multipart()
                    self._answer(sock, ident, json.loads(frame))
        finally:
            sock.close()
            ctx.term()

    def _answer(self, sock: zmq.Socket, ident: bytes, msg: dict) -> None:
        kind, room = msg.get("type"), msg.get("room")
        replies = []
        if kind == "ping":
            replies.append({"type": "pong"})
        elif kind == "bootstrap":
            name, reply = self._bad_reply(room)
            self.counts[f"hostile-decode/{name}"] += 1
            replies += [reply, self._ready_for(room + 1), self._ack(room - 1)]
        elif kind == "transfer_done":  # a room bootstrapped at the real receiver
            self.counts["hostile-decode/ack-not-received"] += 1
            replies.append(self._ack(room))
        for reply in replies:
            sock.send_multipart([ident, reply if isinstance(reply, bytes) else _dump(reply)])

    def _ack(self, room: int) -> dict:
        self.touched.add(room)
        return {"type": "ack", "room": room, "ok": True, "instance": INSTANCE}

    def _ready_for(self, room: int) -> dict:
        """A ready reply for a room it was not asked about, naming the prefill's own pool."""
        self.counts["hostile-decode/ready-not-asked"] += 1
        return self._ready(room, self._own_segment() or {"kind": "shm"})

    def _ready(self, room: int, handle, dst_pages=None, **extra) -> dict:
        self.touched.add(room)
        pool = {**(self.pool or {}), "handle": handle}
        return {
            "type": "bootstrap_reply",
            "room": room,
            "status": "ready",
            "pool": {**pool, **extra},
            "dst_pages": list(range(64)) if dst_pages is None else dst_pages,
            "decode_prefix_len": 0,
            "instance": INSTANCE,
        }

    def _bad_reply(self, room: int) -> tuple[str, dict | bytes]:
        real = (self.pool or {}).get("handle") or {}
        no_shape = {k: v for k, v in real.items() if k != "shape"}
        gone = {**real, "name": "/mppdecode_999999999_abcdef.999999999.0"}
        choices = {
            "no-shape": lambda: self._ready(room, no_shape),
            "list-handle": lambda: self._ready(room, [1, 2]),
            "no-such-segment": lambda: self._ready(room, gone),
            "inside-a-decode-pool": lambda: self._ready(room, {**real, "offset": 64}),
            "own-pool": lambda: self._ready(room, self._own_segment() or no_shape),
            "layout-a-number": lambda: self._ready(room, real, layout=5),
            "no-instance": lambda: {**self._ready(room, real), "instance": ""},
            "page-beyond-int64": lambda: _dump(self._ready(room, real, dst_pages=[2**63])),
        }
        name = self.rng.choice(sorted(choices))
        return name, choices[name]()

    def _own_segment(self) -> dict | None:
        """A handle on one of the prefill's own segments (KV pool, staging), shaped as a
        decode pool of its size would be."""
        layout = (self.pool or {}).get("layout")
        names = ipc.list_segments(f"mpp_{self.worker_pid}_") if self.worker_pid else []
        if not layout or not names:
            return None
        name = self.rng.choice(names)
        try:
            size = os.stat(os.path.join(SHM_DIR, name.lstrip("/"))).st_size
        except OSError:
            return None
        item = _ITEM_BYTES.get(layout["dtype"], 4)
        per_slot = 2 * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"] * item
        slots = size // per_slot // layout["page_size"] * layout["page_size"]
        if slots < layout["page_size"]:
            return None
        shape = [2, layout["num_layers"], slots, layout["num_kv_heads"], layout["head_dim"]]
        return {"kind": "shm", "name": name, "dtype": layout["dtype"], "shape": shape,
                "offset": 0, "nbytes": slots * per_slot, "extra": {}}  # fmt: skip

    # ---- the verdict ---------------------------------------------------------------------------

    def problems(self, records) -> list[str]:
        """Rooms this peer answered for that the prefill called done while the real
        receiver never did: the prefill took a hostile peer's word for them."""
        bad = []
        for rec in records:
            done = rec.replies and rec.replies[0].get("status") == "done"
            decoded = any(r.get("status") == "done" for r in rec.decode_replies)
            if rec.room in self.touched and done and not decoded:
                bad.append(f"{rec.rid}: done on a hostile decode's word (room {rec.room})")
        return bad


def _dump(obj) -> bytes:
    return json.dumps(obj).encode()
