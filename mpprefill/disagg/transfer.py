"""Prefill-side KV transfer: the backend's one background thread (senders: transfer_sender).

The scheduler thread only enqueues (`create_sender`, `send`, `abort`) and reads sender
states; the decode socket, bootstrap retries, page copies and acks live on the thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time

import torch
import zmq

from mpprefill.disagg import protocol as P
from mpprefill.disagg.planes import pool_planes
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.transfer_sender import TransferCmd, TransferSender, check_range
from mpprefill.memory.kv_cache import KVCache
from mpprefill.trace.tracer import clock_ns, get_tracer

logger = logging.getLogger(__name__)

DEFAULT_DECODE_ADDRESS = "127.0.0.1:30200"
_RETRY_S = 0.05  # after a bootstrap reply "unknown": the router has not registered yet
_RESEND_S = 1.0  # a bootstrap that got no reply at all is sent again


class TransferBackend:
    """Owns the transfer thread and the DEALER socket to one decode receiver."""

    name = "base"

    def __init__(
        self,
        kv: KVCache,
        page_size: int,
        decode_address: str | None = None,
        bootstrap_timeout: float = 30.0,
        dead_timeout: float = 5.0,
        heartbeat_interval: float = 0.5,
        fence=None,
    ) -> None:
        """`fence` (the worker's `kv_fence`, optional): `required(pages)` names the forward a
        send's pages need, on the scheduler thread; `wait(gen)` blocks the transfer thread
        until it completed, so no page is read while a forward still writes it (window
        pages: see TransferSender._window)."""
        if page_size < 1 or kv.num_slots < page_size:
            raise ValueError(f"bad page size {page_size} for a pool of {kv.num_slots} slots")
        self.kv, self.page_size = kv, page_size
        self.decode_address = decode_address or DEFAULT_DECODE_ADDRESS
        self.bootstrap_timeout, self.dead_timeout = bootstrap_timeout, dead_timeout
        self.heartbeat_interval = heartbeat_interval
        self.fence = fence
        self.layout = P.PoolLayout.of(kv.buffer, page_size, kv.num_layers)
        self.full_planes, self.swa_planes = pool_planes(kv, page_size)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._live: dict[int, TransferSender] = {}  # transfer thread only
        self._last_heard = self._last_ping = 0.0
        self._closed = False
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.name}", daemon=True)
        self._thread.start()

    # ---- scheduler thread -------------------------------------------------------------

    def create_sender(self, req) -> TransferSender:
        sender = TransferSender(self, str(req.rid), getattr(req, "bootstrap_room", None))
        if sender.room is None:
            sender.fail("the request has no bootstrap_room")
        elif self._closed or not self._thread.is_alive():
            sender.fail("the transfer backend is closed")
        else:
            self.enqueue(TransferCmd("start", sender))
        return sender

    def enqueue(self, cmd: TransferCmd | None) -> None:
        fenced = self.fence is not None and cmd is not None and cmd.kind == "send"
        self._cmds.put((cmd, self.fence.required(cmd.src) if fenced else 0))
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"\0")

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.enqueue(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV transfer thread did not stop within %.1f s", timeout)
            return
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._ctx.term()

    # ---- subclass hooks (transfer thread) -----------------------------------------------

    def _attach(self, pool: dict) -> tuple[P.PoolLayout, object]:
        """Open the decode pool described by `pool`: its layout and a write target.

        NOTE: a sender keeps the target it bootstrapped with, so after a decode restart
        its pages never land in the new decode's pool.
        """
        raise NotImplementedError

    def _write(self, target, src_pages: torch.Tensor, dst_pages: torch.Tensor, planes=None):
        """Copy source pages to destination pages of `target`, pairwise; raise on failure.
        `planes` (PoolPlanes) names the prefill pool, default the full-attention one."""
        raise NotImplementedError

    def _release(self) -> None:
        """Drop what `_attach` opened (the thread's last act)."""

    # ---- transfer thread --------------------------------------------------------------

    def _run(self) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{self.decode_address}")
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(20 if self._live else 200))
                if self._wake_r in events:
                    _drain_pipe(self._wake_r)
                if not self._run_commands():
                    break
                self._read_socket()
                self._tick(time.monotonic())
        except Exception:
            logger.exception("KV transfer thread failed")
        finally:
            self._shutdown()

    def _run_commands(self) -> bool:
        while True:
            try:
                cmd, after = self._cmds.get_nowait()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if cmd.kind == "start":
                self._start(cmd.sender)
            elif cmd.kind == "send":
                self._send_pages(cmd, after)
            else:
                self._live.pop(cmd.sender.room, None)
                self._post(P.Abort(cmd.sender.room))

    def _start(self, s: TransferSender) -> None:
        if s.room in self._live:
            s.fail(f"bootstrap room {s.room} is already in use")
            return
        now = time.monotonic()
        if not self._live:
            self._last_heard = now  # silence while idle does not count
        self._live[s.room] = s
        s.deadline, s.next_try = now + self.bootstrap_timeout, now

    def _send_pages(self, cmd: TransferCmd, after: int = 0) -> None:
        s = cmd.sender
        if self._live.get(s.room) is not s or not s.is_live:
            return
        window = cmd.swa_src is not None and len(cmd.swa_src) > 0
        try:
            if len(cmd.src) or window:
                if after:
                    self.fence.wait(after)  # the forward that wrote these pages completed
                t0 = clock_ns()
                if len(self.full_planes.view):  # none when every layer slides
                    self._write(s.target, cmd.src, cmd.dst)
                if window:
                    self._write(s.target, cmd.swa_src, cmd.swa_dst, self.swa_planes)
                tracer = get_tracer()
                if tracer.enabled:
                    tracer.record("transfer", t0, clock_ns() - t0)
        except Exception as e:
            logger.warning("room %s: writing %d pages failed: %s", s.room, len(cmd.src), e)
            self._fail(s, f"page write failed: {e}")
            return
        s.pages_sent += len(cmd.src)
        if cmd.last:
            self._post(P.TransferDone(s.room, int(cmd.first_token), s.pages_sent))

    def _read_socket(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                logger.warning("bad frame from the decode side: %s", e)
                continue
            self._on_message(msg)

    def _on_message(self, msg: P.Message) -> None:
        s = self._live.get(getattr(msg, "room", None))
        if isinstance(msg, P.BootstrapReply) and s is not None:
            self._on_bootstrap_reply(s, msg)
        elif isinstance(msg, P.Ack) and s is not None:
            self._live.pop(s.room)
            s.succeed() if msg.ok else s.fail(f"decode side refused: {msg.error}")
        elif isinstance(msg, P.Abort):
            if s is not None:
                self._live.pop(s.room)
                s.fail("aborted by the decode side")
            self._post(P.Abort(msg.room))  # confirms: nothing more is written for the room
        elif isinstance(msg, P.ErrorReply) and s is not None:
            self._fail(s, f"decode side error: {msg.error}")
        elif isinstance(msg, P.ErrorReply) and msg.room is None:
            logger.warning("decode side error: %s", msg.error)

    def _on_bootstrap_reply(self, s: TransferSender, msg: P.BootstrapReply) -> None:
        if msg.status == "unknown":
            s.next_try = time.monotonic() + _RETRY_S
        elif msg.status == "error":
            self._fail(s, f"bootstrap refused: {msg.error}")
        elif s.state == KVPoll.Bootstrapping:
            try:
                target, dst = self._check_reply(msg)
            except (ValueError, P.ProtocolError) as e:
                self._fail(s, f"unusable bootstrap reply: {e}")
                return
            prefix = msg.decode_prefix_len
            s.ready(target, dst, prefix, prefix // self.page_size)

    def _check_reply(self, msg: P.BootstrapReply) -> tuple[object, torch.Tensor]:
        if msg.pool is None:
            raise ValueError("no pool in the reply")
        remote, target = self._attach(msg.pool)
        why = self.layout.mismatch(remote)
        if why:
            raise ValueError(why)
        dst = torch.tensor(msg.dst_pages, dtype=torch.int64)
        check_range(dst, remote.num_pages, "destination")
        prefix = msg.decode_prefix_len
        if prefix % self.page_size or prefix > len(dst) * self.page_size:
            raise ValueError(f"bad decode_prefix_len {prefix}")
        return target, dst

    def _tick(self, now: float) -> None:
        if not self._live:
            return
        if now - self._last_heard > self.dead_timeout:
            silent = now - self._last_heard
            for s in list(self._live.values()):
                self._fail(s, f"decode at {self.decode_address} silent for {silent:.1f} s")
            return
        if now - self._last_ping >= self.heartbeat_interval:
            self._post(P.Ping())
            self._last_ping = now
        for s in list(self._live.values()):
            if s.state != KVPoll.Bootstrapping:
                continue
            if now > s.deadline:
                self._fail(s, f"bootstrap timed out after {self.bootstrap_timeout:.1f} s")
            elif now >= s.next_try:
                self._post(P.Bootstrap(s.room))
                s.next_try = now + _RESEND_S

    def _fail(self, s: TransferSender, reason: str) -> None:
        """Fail a live sender from the thread and tell the decode side to free its room."""
        self._live.pop(s.room, None)
        if s.fail(reason):
            self._post(P.Abort(s.room))

    def _post(self, msg: P.Message) -> None:
        try:
            self._sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("decode socket full; dropped %s", type(msg).__name__)

    def _shutdown(self) -> None:
        for s in list(self._live.values()):
            self._fail(s, "the transfer backend is closed")
        while not self._cmds.empty():  # left behind by a crash, or sent after close
            cmd, _ = self._cmds.get_nowait()
            if cmd is not None:
                cmd.sender.fail("the transfer backend is closed")
        self._sock.close(linger=200)
        self._release()


def _drain_pipe(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
