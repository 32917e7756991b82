"""Prefill-side KV transfer: the backend's one background thread (senders: transfer_sender).

The scheduler thread only enqueues (`create_sender`, `send`, `abort`) and reads sender
states; the decode links, bootstrap retries, page copies and acks live on the thread.

Where a room's KV goes: with `decode_address` every room goes to that one receiver; without
it the thread serves the bootstrap endpoint (bootstrap_server.py) and a room goes to the receiver
that a decode server registered for it, the sender waiting in Bootstrapping (up to its
bootstrap timeout) until one does. One link (a DEALER, `_Link`) per decode address, made
on demand and closed once idle, so one prefill feeds any number of decode servers.

At tensor-parallel size N each send reads every shipped rank's pool (rank_pools.py) and writes
its KV heads into the decode's dense pool; the bootstrap names those head ranges.

Whatever answers on a link is trusted with nothing: a reply it cannot use fails its room
only, a message about a room bound to another link is ignored, a pool it names is checked
by `_attach`, and an ack counts only from the receiver's run (`instance`) that answered the
room's bootstrap. The thread itself failing is fatal: `raise_if_dead` raises TransferDied
in the scheduler's loop.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time

import torch
import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.bootstrap_server import DEFAULT_MAX_WAITING, BootstrapEndpoint
from mpprefill.disagg.plane_map import PoolPlanes, pool_planes
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.sender import KVPoll, TransferDied
from mpprefill.disagg.transfer_sender import (
    CommandQueue,
    SenderLimits,
    TransferCmd,
    TransferSender,
    check_range,
)
from mpprefill.memory.kv_cache import KVCache
from mpprefill.ports import DEFAULT_BOOTSTRAP_PORT
from mpprefill.trace.tracer import clock_ns, get_tracer

logger = logging.getLogger(__name__)

DEFAULT_DECODE_ADDRESS = "127.0.0.1:30200"
_RETRY_S = 0.05  # after a bootstrap reply "unknown": the router has not registered yet
_RESEND_S = 1.0  # a bootstrap that got no reply at all is sent again
_LINK_IDLE_S = 30.0  # a link to a decode with no room in flight is closed after this


class _Link:
    """The DEALER to one decode receiver, and its liveness (transfer thread only)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.rooms: set[int] = set()  # live senders bound to this link
        self.last_heard = self.last_ping = self.idle_since = time.monotonic()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self.sock.connect(f"tcp://{address}")

    def post(self, msg: wire.Message) -> None:
        try:
            self.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("decode socket %s full; dropped %s", self.address, type(msg).__name__)


class TransferBackend:
    """Owns the transfer thread, its links to decode receivers and, without a
    `decode_address`, the bootstrap endpoint."""

    name = "base"
    needs_bootstrap_room = True  # a request's room names where its KV goes

    def __init__(
        self,
        kv: KVCache | list[tuple[KVCache, range]],
        page_size: int,
        decode_address: str | None = None,
        bootstrap_timeout: float = 30.0,
        dead_timeout: float = 5.0,
        heartbeat_interval: float = 0.5,
        fence=None,
        transfer_timeout: float = math.inf,
        bootstrap_host: str = "127.0.0.1",
        bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT,
        max_waiting_registrations: int = DEFAULT_MAX_WAITING,
    ) -> None:
        """`kv`: the prefill's KV pool, or every tensor-parallel rank's with the KV heads it
        holds (Worker.kv_shards; rank_pools.py says which are read, each writing its heads).
        `bootstrap_timeout`: how long each sender waits for the decode side's answer to
        its bootstrap and to its final send (TransferSender.poll); `transfer_timeout`: how
        long a sender may stay Transferring, from its first send to the ack (this thread
        fails it). `fence` (the worker's `kv_fence`, optional): `required(pages)` names the
        forward a send's pages need, on the scheduler thread; `wait(gen)` blocks the transfer
        thread until it completed, so no page is read while a forward still writes it (window
        pages: see TransferSender._window). Without `decode_address`, the bootstrap endpoint binds
        `bootstrap_host:bootstrap_port` (0: any free port; `.endpoint.port` says which);
        registrations whose request has not come yet wait at most `bootstrap_timeout`, at
        most `max_waiting_registrations` of them."""
        self.shipped = ShippedKV.of(kv)
        num_slots = self.shipped.shards[0].kv.num_slots
        if page_size < 1 or num_slots < page_size:
            raise ValueError(f"bad page size {page_size} for a pool of {num_slots} slots")
        self.page_size = page_size
        self.decode_address = decode_address and wire.check_address(decode_address)
        self.dead_timeout = dead_timeout
        self.heartbeat_interval = heartbeat_interval
        self.fence = fence
        self.layout = self.shipped.layout(page_size)
        # (full pool, SWA pool or None) of each shipped pool, in head order
        self.planes = [pool_planes(s.kv, page_size, s.heads) for s in self.shipped.shards]
        swa = self.planes[0][1]
        swa_pages = None if swa is None else swa.num_pages
        self.limits = SenderLimits(
            self.layout.num_pages, swa_pages, bootstrap_timeout, transfer_timeout
        )
        self.commands = CommandQueue(fence)
        self._live: dict[int, TransferSender] = {}  # transfer thread only, as are:
        self._next_try: dict[int, float] = {}  # room -> when to send its bootstrap again
        self._links: dict[str, _Link] = {}  # by decode address
        self._link_of: dict[int, _Link] = {}  # room -> the link its sender is bound to
        self._registrant: dict[int, bytes] = {}  # room -> who registered it (endpoint)
        self._closed = False
        self.death: str | None = None  # why the thread failed
        self._ctx = zmq.Context()
        self.endpoint = None
        if self.decode_address is None:
            try:
                self.endpoint = BootstrapEndpoint(
                    self._ctx,
                    bootstrap_host,
                    bootstrap_port,
                    bootstrap_timeout,
                    max_waiting_registrations,
                )
            except zmq.ZMQError:
                self._ctx.term()
                raise
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.name}", daemon=True)
        self._thread.start()

    # ---- scheduler thread -------------------------------------------------------------

    def create_sender(self, req) -> TransferSender:
        room = getattr(req, "bootstrap_room", None)
        sender = TransferSender(str(req.rid), room, self.commands, self.limits)
        sender.registered = self.endpoint is None
        if room is None:
            sender.fail("the request has no bootstrap_room")
        elif self.death is not None or self._closed or not self._thread.is_alive():
            sender.fail(self.death or "the transfer backend is closed")
        else:
            sender.hand_over()
            self.commands.put(TransferCmd("start", sender))
        return sender

    def refuse(self, room: int, reason: str, code: int | None = None) -> None:
        """The request for `room` was refused before it got a sender (overloaded, bad
        input, aborted on arrival): a decode server that registered the room, or registers
        it later, is refused at once instead of waiting for KV that never comes. `code`,
        the status the server replied with, goes with the refusal."""
        if self.endpoint is not None and not self._closed:
            cmd = TransferCmd("refuse", None, room=room, reason=reason, code=code)
            self.commands.put(cmd)

    def raise_if_dead(self) -> None:
        """TransferDied once the thread has failed: no request could send its KV again."""
        if self.death is not None:
            raise TransferDied(self.death)

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.commands.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV transfer thread did not stop within %.1f s", timeout)
            return
        self.commands.close()
        self._ctx.term()

    # ---- subclass hooks (transfer thread) -----------------------------------------------

    def _attach(self, pool: dict, address: str) -> tuple[wire.PoolLayout, object]:
        """Open the decode pool described by `pool`, which the receiver at `address` named:
        its layout and a write target.

        NOTE: a sender keeps the target it bootstrapped with, so after a decode restart
        its pages never land in the new decode's pool.
        """
        raise NotImplementedError

    def _write(self, target, src_pages: torch.Tensor, dst_pages: torch.Tensor, planes: PoolPlanes):
        """Copy source pages of the prefill pool `planes` to destination pages of `target`,
        pairwise, at the pool's KV heads; raise on failure."""
        raise NotImplementedError

    def _release(self) -> None:
        """Drop what `_attach` opened (the thread's last act)."""

    # ---- transfer thread --------------------------------------------------------------

    def _run(self) -> None:
        self._poller = zmq.Poller()
        self._poller.register(self.commands.wake_fd, zmq.POLLIN)
        if self.endpoint is not None:
            self._poller.register(self.endpoint.sock, zmq.POLLIN)
        else:
            self._link(self.decode_address)
        try:
            while True:
                events = dict(self._poller.poll(20 if self._live else 200))
                if self.commands.wake_fd in events:
                    self.commands.clear_wake()
                if not self._run_commands():
                    break
                for link in list(self._links.values()):
                    if link.sock in events:
                        self._read_link(link)
                if self.endpoint is not None and self.endpoint.sock in events:
                    self._read_endpoint()
                self._tick(time.monotonic())
        except Exception as e:
            self.death = wire.brief(f"the KV transfer thread failed: {type(e).__name__}: {e}")
            logger.exception("KV transfer thread failed")
        finally:
            self._shutdown()

    def _link(self, address: str) -> _Link:
        """The link to the receiver at `address`, made on first use."""
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = _Link(self._ctx, address)
            self._poller.register(link.sock, zmq.POLLIN)
        return link

    def _unlink(self, link: _Link) -> None:
        self._poller.unregister(link.sock)
        link.sock.close(linger=0)
        del self._links[link.address]

    def _reconnect(self, link: _Link) -> None:
        """A fresh DEALER to the same address, in place of `link` (which has no rooms).

        NOTE: ZeroMQ closes a link that brings a frame over MAXMSGSIZE and never
        reconnects it; `_tick` replaces a link that stays silent instead.
        """
        self._unlink(link)
        self._link(link.address)

    def _bind(self, s: TransferSender, address: str) -> None:
        """Send room `s.room`'s KV to the receiver at `address` from now on."""
        link = self._link(address)
        if not link.rooms:
            link.last_heard = time.monotonic()  # silence while idle does not count
        link.rooms.add(s.room)
        self._link_of[s.room] = link
        s.registered = True
        self._next_try[s.room] = 0.0  # at once

    def _run_commands(self) -> bool:
        while True:
            try:
                cmd, after = self.commands.get()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if cmd.kind == "refuse":
                self._refuse(cmd.room, cmd.reason, cmd.code)
            elif cmd.kind == "start":
                self._start(cmd.sender)
            elif cmd.kind == "send":
                self._send_pages(cmd, after)
            else:  # "abort": the sender failed already; the decode side frees its room
                self._fail(cmd.sender, cmd.sender.failure_reason())

    def _start(self, s: TransferSender) -> None:
        if s.room in self._live:
            s.fail(f"bootstrap room {s.room} is already in use")
            s.let_go()
            return
        self._live[s.room] = s
        if self.endpoint is None:
            self._bind(s, self.decode_address)
            return
        reg = self.endpoint.take(s.room)
        if reg is not None:
            self._registrant[s.room] = reg.ident
            self._bind(s, reg.address)

    def _drop(self, s: TransferSender) -> None:
        """The thread lets go of `s`: none of its pages is read after this. A sender that
        no decode had registered yet failed: its room is refused to a late registrant."""
        if self._live.get(s.room) is s:
            del self._live[s.room]
            self._next_try.pop(s.room, None)
            self._registrant.pop(s.room, None)
            link = self._link_of.pop(s.room, None)
            if link is not None:
                link.rooms.discard(s.room)
                link.idle_since = time.monotonic()
            elif self.endpoint is not None:
                self._refuse(s.room, s.failure_reason())
        s.let_go()

    def _refuse(self, room: int, reason: str, code: int | None = None) -> None:
        """Refuse `room` to its registrant: the one waiting now, or the next one within the
        registrations' expiry."""
        if room in self._live:  # a live request of that room: not this refusal's
            return
        self.endpoint.refuse_room(
            room, f"the prefill refused the request: {wire.brief(reason)}", code
        )

    def _read_endpoint(self) -> None:
        """Registrations and withdrawals from decode servers (disagg/bootstrap_server.py)."""
        for ident, msg in self.endpoint.read():
            if isinstance(msg, wire.Abort):
                self._withdraw(ident, msg.room)
            else:
                self._register(ident, msg)

    def _register(self, ident: bytes, msg: wire.RegisterRoom) -> None:
        s = self._live.get(msg.room)
        link = self._link_of.get(msg.room)
        refused = self.endpoint.take_refusal(msg.room)
        code = None
        if s is None and refused is not None:
            why, code = refused
        elif s is None:
            why = self.endpoint.hold(ident, msg)
        elif link is None:
            self._registrant[msg.room] = ident
            self._bind(s, msg.address)
            why = None
        else:
            why = None if link.address == msg.address else f"room {msg.room} is bound elsewhere"
        if why is None:
            self.endpoint.accept(ident, msg.room)
        else:
            self.endpoint.refuse(ident, msg.room, why, code)

    def _withdraw(self, ident: bytes, room: int) -> None:
        """The registrant gave the room up (its request ended on the decode side)."""
        s = self._live.get(room)
        if s is not None and self._registrant.get(room) == ident:
            self._fail(s, "the decode side withdrew the room")
        elif not self.endpoint.withdraw(ident, room):
            self.endpoint.refuse(ident, room, f"room {room} is not registered by this peer")

    def _send_pages(self, cmd: TransferCmd, after: int = 0) -> None:
        s = cmd.sender
        if self._live.get(s.room) is not s or not s.is_live:
            return
        window = cmd.swa_src is not None and len(cmd.swa_src) > 0
        try:
            if len(cmd.src) or window:
                if after:
                    self.fence.wait(after)  # the forward that wrote these pages completed
                    if not s.is_live:  # aborted meanwhile: its pages may be freed soon
                        return
                t0 = clock_ns()
                for full, swa in self.planes:  # each shipped pool writes its KV heads
                    if len(full.view):  # none when every layer slides
                        self._write(s.target, cmd.src, cmd.dst, full)
                    if window:
                        self._write(s.target, cmd.swa_src, cmd.swa_dst, swa)
                tracer = get_tracer()
                if tracer.enabled:
                    tracer.record("transfer", t0, clock_ns() - t0)
        except Exception as e:
            logger.warning("room %s: writing %d pages failed: %s", s.room, len(cmd.src), e)
            self._fail(s, f"page write failed: {e}")
            return
        s.wrote(len(cmd.src))
        if cmd.last:
            s.awaiting_ack = True
            logprob, top = (None, None) if cmd.first_logprob is None else cmd.first_logprob
            done = wire.TransferDone(
                s.room, int(cmd.first_token), s.pages_sent, s.instance, logprob, top
            )
            self._link_of[s.room].post(done)

    def _read_link(self, link: _Link) -> None:
        while True:
            try:
                frame = link.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            link.last_heard = time.monotonic()
            try:
                msg = wire.decode(frame)
            except wire.WireError as e:
                logger.warning("bad frame from the decode at %s: %s", link.address, e)
                s = self._live.get(e.room)
                if s is not None and self._link_of.get(e.room) is link:
                    self._fail(s, f"bad frame from the decode side: {e}")
                continue
            room = getattr(msg, "room", None)
            s = self._live.get(room)
            if s is not None and self._link_of.get(room) is not link:
                s = None  # another decode's room: not this peer's to answer for
            try:
                self._on_message(link, s, msg)
            except Exception as e:  # a peer's message fails its room, never this thread
                why = wire.brief(f"{type(e).__name__}: {e}")
                logger.warning("unusable %s from the decode side: %s", type(msg).__name__, why)
                if s is not None:
                    self._fail(s, f"unusable {type(msg).__name__}: {why}")

    def _on_message(self, link: _Link, s: TransferSender | None, msg: wire.Message) -> None:
        if isinstance(msg, wire.BootstrapReply) and s is not None:
            self._on_bootstrap_reply(s, msg)
        elif isinstance(msg, wire.Ack) and s is not None:
            self._on_ack(s, msg)
        elif isinstance(msg, wire.Abort):
            if s is not None:
                self._drop(s)
                s.fail("aborted by the decode side")
            link.post(wire.Abort(msg.room))  # confirms: nothing more is written for the room
        elif isinstance(msg, wire.ErrorReply) and s is not None:
            self._fail(s, f"decode side error: {wire.brief(msg.error)}")
        elif isinstance(msg, wire.ErrorReply) and msg.room is None:
            logger.warning("decode side error: %s", wire.brief(msg.error))

    def _on_ack(self, s: TransferSender, msg: wire.Ack) -> None:
        """Only the receiver run that answered the bootstrap acks, and only after the last
        send: another run never saw the room's pages."""
        if not s.awaiting_ack or msg.instance != s.instance:
            why = "before the last send" if not s.awaiting_ack else "from another decode run"
            self._fail(s, f"ack {why} (instance {wire.quote(msg.instance)})")
        elif msg.ok:
            self._drop(s)
            s.succeed()
        else:
            self._drop(s)
            s.fail(f"decode side refused: {wire.brief(msg.error or '')}")

    def _on_bootstrap_reply(self, s: TransferSender, msg: wire.BootstrapReply) -> None:
        if msg.status == "unknown":
            self._next_try[s.room] = time.monotonic() + _RETRY_S
        elif msg.status == "error":
            self._fail(s, f"bootstrap refused: {wire.brief(msg.error or '')}")
        elif s.state == KVPoll.Bootstrapping:
            try:
                target, dst = self._check_reply(msg, self._link_of[s.room].address)
            except Exception as e:  # whatever the peer sent, only this room fails
                self._fail(s, f"unusable bootstrap reply: {type(e).__name__}: {e}")
                return
            prefix = msg.decode_prefix_len
            s.ready(target, dst, prefix, prefix // self.page_size, msg.instance)

    def _check_reply(self, msg: wire.BootstrapReply, address: str) -> tuple[object, torch.Tensor]:
        if msg.pool is None:
            raise ValueError("no pool in the reply")
        if not msg.instance:
            raise ValueError("no decode instance in the reply")
        remote, target = self._attach(msg.pool, address)
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
        if self.endpoint is not None:
            self.endpoint.expire(now)
        for link in list(self._links.values()):
            self._tend(link, now)
        self._expire(now)
        self._ask_again(now)

    def _tend(self, link: _Link, now: float) -> None:
        """Ping a busy link, replace one silent past the dead timeout, close an idle one."""
        if not link.rooms:
            if link.address != self.decode_address and now - link.idle_since > _LINK_IDLE_S:
                self._unlink(link)
            return
        if now - link.last_heard > self.dead_timeout:
            silent = now - link.last_heard
            for room in list(link.rooms):
                self._fail(self._live[room], f"decode at {link.address} silent for {silent:.1f} s")
            self._reconnect(link)
        elif now - link.last_ping >= self.heartbeat_interval:
            link.post(wire.Ping())
            link.last_ping = now

    def _expire(self, now: float) -> None:
        """Fail senders Transferring past their deadline, whatever the decode side says."""
        late = [s for s in self._live.values() if now > s.transfer_by]
        for s in late:
            self._fail(s, f"KV transfer not done within {self.limits.transfer_timeout:.1f} s")

    def _ask_again(self, now: float) -> None:
        """Bootstrap rooms without an answer again: the router may not have registered them
        yet, or the reply was lost. How long a sender waits is its own deadline."""
        for room, link in self._link_of.items():
            if self._live[room].state == KVPoll.Bootstrapping and now >= self._next_try[room]:
                shipped, dtype = self.shipped, self.layout.dtype
                link.post(wire.Bootstrap(room, shipped.tp_size, shipped.kv_heads, dtype))
                self._next_try[room] = now + _RESEND_S

    def _fail(self, s: TransferSender, reason: str) -> None:
        """Fail a sender from the thread and tell the decode side to free its room (once:
        a sender leaves `_live` only here, on an answer, or with its abort posted)."""
        was_live = self._live.get(s.room) is s
        link = self._link_of.get(s.room) if was_live else None
        self._drop(s)
        if (s.fail(reason) or was_live) and link is not None:
            link.post(wire.Abort(s.room))

    def _shutdown(self) -> None:
        why = self.death or "the transfer backend is closed"
        for s in list(self._live.values()):
            self._fail(s, why)
        while True:  # left behind by a crash, or sent after close
            try:
                cmd, _ = self.commands.get()
            except queue.Empty:
                break
            if cmd is not None and cmd.sender is not None:
                cmd.sender.fail(why)
                cmd.sender.let_go()
        for link in self._links.values():
            link.sock.close(linger=200)
        if self.endpoint is not None:
            self.endpoint.close()
        self._release()
