"""Prefill-side KV transfer: the backend's one background thread (senders: transfer_sender).

The scheduler thread only enqueues (`create_sender`, `send`, `abort`) and reads sender
states; the decode links, bootstrap retries, page copies and acks live on the thread.

Where a room's KV goes: with `decode_address` every room goes to that one receiver; without
it the thread serves the bootstrap endpoint (bootstrap_server.py) and a room goes to the receiver
that a decode server registered for it, the sender waiting in Bootstrapping (up to its
bootstrap timeout) until one does. One link (a DEALER) per decode address, made on demand
and closed once idle, so one prefill feeds any number of decode servers.

At tensor-parallel size N each send reads every shipped rank's pool (rank_pools.py) and writes
its KV heads into the decode's dense pool; the bootstrap names those head ranges.

The backend owns the thread and composes its parts, each called from the thread only:

    LiveRooms           live_rooms.py           senders by room: start, bind, drop, fail, tick
      DecodeLinks       decode_links.py         a DEALER per decode address; room -> link
      RoomRegistry      room_registry.py        registrations (over BootstrapEndpoint)
      TransferDeadlines transfer_deadlines.py   what is due when: bootstraps, expiry, pings
    DecodeReplies       decode_replies.py       each frame from a link, applied to its room
    PageWrites          page_writes.py          which pages a send writes where
    LayerwiseSends      layerwise_sends.py      layer-wise sends: which layer is due
    TransferLink        transfer_link.py        completions out, held by an emulated link

With `layers` (the worker's per-layer counter) a send may be layer-wise: queued when its
forward is submitted, each layer written as soon as the forward wrote it. Commands behind a
send of a sender whose pages still go layer by layer (its last send) wait for them, in order.

It polls, runs the commands the senders queue, and does what needs the decode pool: the
subclass hooks (`_attach`, `_write`, `_release`: shm_backend.py, mooncake_backend.py) open
the pool a bootstrap reply names and write each send's pages into it.

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
from collections import deque

import torch
import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.bootstrap_server import DEFAULT_MAX_WAITING, BootstrapEndpoint
from mpprefill.disagg.decode_links import DecodeLink, DecodeLinks
from mpprefill.disagg.decode_replies import DecodeReplies
from mpprefill.disagg.layerwise_sends import LayerSend, LayerwiseSends
from mpprefill.disagg.live_rooms import LiveRooms
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.plane_map import PoolPlanes
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.room_registry import RoomRegistry
from mpprefill.disagg.sender import TransferDied
from mpprefill.disagg.transfer_deadlines import TransferDeadlines
from mpprefill.disagg.transfer_link import TransferLink
from mpprefill.disagg.transfer_sender import CommandQueue, TransferCmd, TransferSender
from mpprefill.layer_configs import LinkConfig
from mpprefill.memory.kv_cache import KVCache
from mpprefill.ports import DEFAULT_BOOTSTRAP_PORT
from mpprefill.trace.tracer import clock_ns, get_tracer

logger = logging.getLogger(__name__)

DEFAULT_DECODE_ADDRESS = "127.0.0.1:30200"
LAST_LAYER_POLL_S = 1e-4  # a forward's last layer: its end is watched this closely


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
        layers=None,
        link: LinkConfig | None = None,
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
        most `max_waiting_registrations` of them. `layers` (the worker's `layer_progress`,
        optional): how far each forward wrote its KV, layer by layer; with it, sends that
        name their forward (`layer_seq`) go layer by layer, and `layers` stays set only
        where the pool allows it (no sliding-window pool). `link`: an emulated network link
        the pages and completions take (transfer_link.py); None: none."""
        self.shipped = ShippedKV.of(kv)
        self.pages = PageWrites(self.shipped, page_size)
        if layers is not None and not self.pages.can_go_by_layer:
            logger.warning("layer-wise send off: the KV pool has sliding-window layers")
            layers = None
        self.layers = layers
        self.pages.layerwise = layers is not None
        self.layerwise = None if layers is None else LayerwiseSends(layers)
        self._held: deque[tuple[TransferCmd, int]] = deque()  # behind a layer-wise send
        self.page_size = page_size
        self.layout = self.pages.layout
        self.planes = self.pages.planes
        self.decode_address = decode_address and wire.check_address(decode_address)
        self.fence = fence
        self.limits = self.pages.limits(bootstrap_timeout, transfer_timeout)
        self.commands = CommandQueue(fence)
        self._closed = False
        self.death: str | None = None  # why the thread failed
        self._ctx = zmq.Context()
        self.endpoint = self._open_endpoint(
            bootstrap_host, bootstrap_port, bootstrap_timeout, max_waiting_registrations
        )
        self._poller = zmq.Poller()
        self._deadlines = TransferDeadlines(transfer_timeout, dead_timeout, heartbeat_interval)
        self.rooms = self._live_rooms()
        self.replies = DecodeReplies(self.rooms, self._deadlines)
        self.out = TransferLink(self.rooms, link, self.layout)
        self._thread = threading.Thread(target=self._run, name=f"kv-{self.name}", daemon=True)
        self._thread.start()

    def _live_rooms(self) -> LiveRooms:
        """The thread's rooms, over links polled by its poller and, without a fixed
        `decode_address`, the endpoint's registrations."""
        links = DecodeLinks(self._ctx, self._poller, self._deadlines, self.decode_address)
        registry = None if self.endpoint is None else RoomRegistry(self.endpoint)
        return LiveRooms(links, registry, self._deadlines, self.pages)

    def _open_endpoint(
        self, host: str, port: int, expiry_s: float, max_waiting: int
    ) -> BootstrapEndpoint | None:
        """The bootstrap endpoint, unless every room goes to the fixed `decode_address`."""
        if self.decode_address is not None:
            return None
        try:
            return BootstrapEndpoint(self._ctx, host, port, expiry_s, max_waiting)
        except zmq.ZMQError:
            self._ctx.term()
            raise

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
        self._poller.register(self.commands.wake_fd, zmq.POLLIN)
        if self.endpoint is not None:
            self._poller.register(self.endpoint.sock, zmq.POLLIN)
        else:
            self.rooms.links.link(self.decode_address)
        try:
            while self._step():
                pass
        except Exception as e:
            self.death = wire.brief(f"the KV transfer thread failed: {type(e).__name__}: {e}")
            logger.exception("KV transfer thread failed")
        finally:
            self._shutdown()

    def _step(self) -> bool:
        """One round: commands, frames from the links and the endpoint, then what is due.
        False once the stop command came."""
        poll_ms = self.out.poll_ms(self._poll_ms(), time.monotonic())
        events = dict(self._poller.poll(poll_ms))
        if self.commands.wake_fd in events:
            self.commands.clear_wake()
        if not self._run_commands():
            return False
        self._send_layers()
        for link in self.rooms.links.readable(events):
            self._read_link(link)
        if self.endpoint is not None and self.endpoint.sock in events:
            self.rooms.read_registrations()
        self._tick(time.monotonic())
        return True

    def _poll_ms(self) -> int:
        """Layer-wise sends wait for layers a forward is computing: look at its counter
        each millisecond (a layer takes longer), and every LAST_LAYER_POLL_S while a
        forward computes its last layer, whose end the first token waits for."""
        lw = self.layerwise
        if lw is not None and lw.waiting:
            if not lw.finishing():
                return 1
            time.sleep(LAST_LAYER_POLL_S)
            return 0
        return 20 if self.rooms.busy else 200

    def _run_commands(self) -> bool:
        while True:
            try:
                cmd, after = self.commands.get()
            except queue.Empty:
                return True
            if cmd is None:
                return False
            if self._held or self._waits_for_layers(cmd):
                self._held.append((cmd, after))
            else:
                self._do(cmd, after)

    def _waits_for_layers(self, cmd: TransferCmd) -> bool:
        """A whole send of a sender whose pages still go layer by layer."""
        lw = self.layerwise
        whole = cmd.kind == "send" and not cmd.layer_seq
        return lw is not None and whole and lw.holds(cmd.sender)

    def _do(self, cmd: TransferCmd, after: int) -> None:
        if cmd.kind == "send" and cmd.layer_seq:
            self._send_by_layer(cmd)
        elif cmd.kind == "refuse":
            self.rooms.refuse(cmd.room, cmd.reason, cmd.code)
        elif cmd.kind == "start":
            self.rooms.start(cmd.sender)
        elif cmd.kind == "send":
            self._send_pages(cmd, after)
        else:  # "abort": the sender failed already; the decode side frees its room
            self.rooms.fail(cmd.sender, cmd.sender.failure_reason())

    def _send_by_layer(self, cmd: TransferCmd) -> None:
        """Take a layer-wise send; without a per-layer counter, send it whole once its
        forward is done."""
        if self.layerwise is None:
            self._send_pages(cmd, cmd.layer_seq if self.fence is not None else 0)
        elif self.rooms.holds(cmd.sender) and cmd.sender.is_live:
            self.layerwise.add(cmd)

    def _send_layers(self) -> None:
        """Write every layer the forwards have finished of the layer-wise sends, then run
        the commands that waited for them."""
        if self.layerwise is None:
            return
        self.layerwise.prune(lambda s: self.rooms.holds(s) and s.is_live)
        for x, layer in self.layerwise.due():
            if not x.dropped:
                self._send_layer(x, layer)
        while self._held and not self._waits_for_layers(self._held[0][0]):
            self._do(*self._held.popleft())

    def _send_layer(self, x: LayerSend, layer: int) -> None:
        s = x.cmd.sender
        if not self.rooms.holds(s) or not s.is_live:
            self.layerwise.drop(x)  # its pages may be freed: none is read
            return
        try:
            self._write_layer(x, layer)
        except Exception as e:
            logger.warning("room %s: writing layer %d failed: %s", s.room, layer, e)
            self.layerwise.drop(x)
            self.rooms.fail(s, f"page write failed: {e}")
            return
        if self.layerwise.overtaken(x, layer) and self._reused(x):
            self.layerwise.drop(x)
            self.rooms.fail(s, "a page went to a later forward before its layer was sent")
        elif self.layerwise.wrote(x, layer):
            s.wrote(len(x.cmd.src))
            if s.layerwise:
                self.out.done(s, self.pages.layers_written(s, x.cmd))

    def _write_layer(self, x: LayerSend, layer: int) -> None:
        t0 = clock_ns()
        for src, dst, planes in self.pages.layer_writes(x.cmd, layer):
            self.out.handed(src, planes)  # one layer's bytes on the link, as it is ready
            self._write(x.cmd.sender.target, src, dst, planes)
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record("transfer-layer", t0, clock_ns() - t0, layer)

    def _reused(self, x: LayerSend) -> bool:
        """Some page of `x` was handed to a later forward (the KV write fence says which
        forward writes each page last): what was read of it may be that forward's."""
        return self.fence is not None and self.fence.required(x.cmd.src) > x.seq

    def _send_pages(self, cmd: TransferCmd, after: int = 0) -> None:
        s = cmd.sender
        if not self.rooms.holds(s) or not s.is_live:
            return
        try:
            if self.pages.moves_pages(cmd) and not self._write_pages(cmd, after):
                return
        except Exception as e:
            logger.warning("room %s: writing %d pages failed: %s", s.room, len(cmd.src), e)
            self.rooms.fail(s, f"page write failed: {e}")
            return
        s.wrote(len(cmd.src))
        if s.layerwise and len(cmd.src):
            self.out.done(s, self.pages.layers_written(s, cmd))
        if cmd.last:
            s.awaiting_ack = True
            self.out.done(s, self.pages.transfer_done(s, cmd))

    def _write_pages(self, cmd: TransferCmd, after: int) -> bool:
        """Write the send's pages once the forward `after` that wrote them completed; False
        when the sender was aborted meanwhile (its pages may be freed soon: none is read)."""
        s = cmd.sender
        if after:
            self.fence.wait(after)
            if not s.is_live:
                return False
        t0 = clock_ns()
        for src, dst, planes in self.pages.writes(cmd):
            self.out.handed(src, planes)
            self._write(s.target, src, dst, planes)
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record("transfer", t0, clock_ns() - t0)
        return True

    def _read_link(self, link: DecodeLink) -> None:
        while (frame := link.recv()) is not None:
            ready = self.replies.on_frame(link, frame)
            if ready is not None:
                self._ready(*ready)

    def _ready(self, s: TransferSender, msg: wire.BootstrapReply) -> None:
        """The decode side answered the room's bootstrap with its pages: open its pool."""
        try:
            target, dst = self._check_reply(msg, self.rooms.address_of(s.room))
        except Exception as e:  # whatever the peer sent, only this room fails
            self.rooms.fail(s, f"unusable bootstrap reply: {type(e).__name__}: {e}")
            return
        prefix = msg.decode_prefix_len
        layerwise = self.layers is not None  # its bootstrap said so
        s.ready(target, dst, prefix, prefix // self.page_size, msg.instance, layerwise)

    def _check_reply(self, msg: wire.BootstrapReply, address: str) -> tuple[object, torch.Tensor]:
        """The decode pool the reply names, opened, and the room's pages in it."""
        if msg.pool is None:
            raise ValueError("no pool in the reply")
        if not msg.instance:
            raise ValueError("no decode instance in the reply")
        remote, target = self._attach(msg.pool, address)
        return target, self.pages.check_reply(msg, remote)

    def _tick(self, now: float) -> None:
        self.out.release(now)
        self.rooms.tick(now)

    def _shutdown(self) -> None:
        why = self.death or "the transfer backend is closed"
        self.rooms.fail_all(why)
        self._fail_queued(why)
        self.rooms.close()
        self._release()

    def _fail_queued(self, why: str) -> None:
        """Fail the senders of commands left behind by a crash, or sent after close."""
        left = [] if self.layerwise is None else self.layerwise.take_all()
        left += [cmd for cmd, _ in self._held]
        self._held.clear()
        for cmd in left:
            if cmd.sender is not None:
                cmd.sender.fail(why)
                cmd.sender.let_go()
        while True:
            try:
                cmd, _ = self.commands.get()
            except queue.Empty:
                return
            if cmd is not None and cmd.sender is not None:
                cmd.sender.fail(why)
                cmd.sender.let_go()
