"""The decode receiver: receive pages per bootstrap room, answer the router, verify on demand.

One ROUTER socket (`--receiver-port`) serves a registering router (register, abort) and the
prefill transfer backends (bootstrap, transfer_done, abort, ping). A room's pages are freed
once the router has its answer. Verification runs on a helper thread so the loop keeps
answering pings.

A room may also belong to the decode server in this process (`add_request`, server.py):
such a room has no router; its ending goes to `failed`, and a room whose KV arrived goes
to `arrived` with its pages, which are then the server's.

A room belongs to the connection that registered it (the router) and to the first prefill
that bootstraps it (`Room.peer`): a bootstrap, transfer_done or abort from anyone else is
refused. Every reply to a prefill names this run (`instance`), and a transfer_done must
name it back. A prefill that sends layer by layer says so in its bootstrap; the room then
counts each page's layers from the prefill's `layers_written` and takes transfer_done only
once every page has every layer. A bootstrap names the prefill's KV layout (K and V per
head, or a latent model's one row per token), its tensor-parallel size, the KV heads of
each pool it writes and their dtype; a room whose layout is not this pool's, whose pools do
not tile this pool's heads, or hold another dtype than this pool's, fails at its bootstrap,
before any page is written (a prefill at any TP size fills this pool, each pool its heads
of every slot; pages are copied as bytes). A latent model (DeepSeek-V3) gets a latent pool,
one row per token and layer, as its prefill keeps.
Everything waits against a deadline: registrations for pages (`--register-timeout`), rooms
for their KV (`--waiting-timeout`), aborted rooms for the prefill's confirmation
(_DRAIN_S); registrations waiting are capped.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import torch
import zmq

from ipc.codec import MessageError
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.delay import TransferDelay
from mpprefill.decode.verify import KVVerifier
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_decode_pool
from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig
from mpprefill.model.config import Dtypes, resolve_dtypes
from mpprefill.model.loader import read_config
from mpprefill.sampling.token_logprob import TokenLogprob

logger = logging.getLogger(__name__)
_DRAIN_S = 5.0  # pages of a room aborted by the router wait this long for the prefill's ok


@dataclass(slots=True, eq=False)
class Room:
    rid: str
    room: int
    router: bytes  # identity the router's answer goes to
    input_ids: list[int]
    pages: torch.Tensor
    prefix_len: int = 0
    deadline: float = 0.0  # the router gets an error if the KV is not in by then
    peer: bytes | None = None  # the prefill backend that bootstrapped it
    verifying: bool = False
    client: bool = False  # the decode server's request, not a router's
    first_logprob: TokenLogprob | None = None  # sent with the first token, when asked
    # layers in of each page the prefill sends (a layer-wise prefill); None: whole pages
    layers: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class Pending:
    """A registration waiting for free pages."""

    reg: wire.Register
    router: bytes
    deadline: float
    client: bool = False


def pool_model_config(args: DecodeArgs) -> ModelConfig:
    """The model whose KV this receiver's pool holds, in the dtype --dtype serves it in."""
    config = ModelConfig.tiny() if args.model_path is None else read_config(args.model_path)
    served = resolve_dtypes(args.dtype, "auto", config.dtype).model
    config = dataclasses.replace(config, dtype=served)
    if args.emulate_model is None:
        return config
    from mpprefill.emulation.device import host_config

    return host_config(config, args.emulate_model)


def pool_dtypes(args: DecodeArgs, config: ModelConfig) -> Dtypes:
    """The model's and the pool's dtype (`config`: pool_model_config's), resolved as the
    prefill resolves them from the same flags and checkpoint."""
    return resolve_dtypes(args.dtype, args.kv_cache_dtype, config.dtype)


class DecodeReceiver:
    def __init__(self, args: DecodeArgs, delay: TransferDelay | None = None, model=None) -> None:
        """`delay` (test only): hold finished rooms' answers a while (decode/delay.py);
        `model`: the decode server's, which --verify then shares."""
        self.args = args
        self.delay = delay or TransferDelay()
        config = pool_model_config(args)
        layers, heads, dim = KVCache.model_dims(config)
        num_pages = args.max_total_tokens // args.page_size
        dtypes = pool_dtypes(args, config)
        kv_layout = "latent" if config.is_latent else "heads"
        self.layout = wire.PoolLayout(
            dtypes.kv, layers, num_pages * args.page_size, heads, dim, args.page_size, kv_layout
        )
        # first: bad flags leak no pool
        self.verifier = KVVerifier(args, model, dtypes.kv_torch) if args.verify else None
        backend = args.disaggregation_transfer_backend
        # NOTE: the pool's peers (a mooncake session) are named by the advertised host, the
        # one the prefills reach this receiver at, as its registrations name it.
        self.pool = make_decode_pool(backend, self.layout, dtypes.kv_torch, args.advertised_host)
        self._pool_desc = self.pool.describe()
        self.allocator = PagedTokenAllocator(num_pages, args.page_size)
        self.instance = secrets.token_hex(8)
        # NOTE: each of these dicts is in order of its deadline (one timeout each), so
        # expiry looks at its first entries only.
        self.rooms: dict[int, Room] = {}
        self.pending: dict[int, Pending] = {}  # by room
        self.draining: dict[int, tuple[torch.Tensor, float, bytes]] = {}  # pages, until, peer
        self._checks: list[tuple[Room, int, Future]] = []
        self._held: deque[tuple[float, Room, wire.RouterReply]] = deque()  # due, room, answer
        # The decode server's rooms that ended: (room, first token) with the KV in, its
        # pages handed over; (rid, room, error) otherwise. The server empties both.
        self.arrived: list[tuple[Room, int]] = []
        self.failed: list[tuple[str, int, str]] = []
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 200)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        try:
            self.port = self._bind(f"tcp://{args.host}", args.receiver_listen.port)
        except zmq.ZMQError:
            self.sock.close()
            self.pool.close()
            raise
        logger.info(
            "decode receiver on %s:%d, %d pages (%s)", args.host, self.port, num_pages, backend
        )

    def _bind(self, url: str, port: int) -> int:
        if port == 0:
            return self.sock.bind_to_random_port(url)
        self.sock.bind(f"{url}:{port}")
        return port

    @property
    def address(self) -> str:
        """Where the prefills reach this receiver (it binds --host, see `__init__`)."""
        return f"{self.args.advertised_host}:{self.port}"

    @property
    def busy(self) -> bool:
        """Checks or held answers are due soon: poll briefly."""
        return bool(self._checks or self._held)

    # ---- loop ----------------------------------------------------------------------------

    def read(self) -> None:
        """Handle the frames waiting on the socket (up to 256)."""
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_frames(frames)

    def tick(self) -> None:
        """Finished checks, held answers that are due, deadlines."""
        self._collect_checks()
        self._release_held(now := time.monotonic())
        self._expire(now)

    # ---- the decode server's rooms -------------------------------------------------------

    def add_request(self, rid: str, room: int, input_ids: list[int]) -> str | None:
        """Wait for room `room`'s KV on behalf of the decode server; why not (None: added)."""
        return self._queue(wire.Register(rid, room, input_ids), b"", client=True)

    def end_request(self, room: int, error: str) -> bool:
        """End a room of the decode server before its KV arrived (it reaches `failed`);
        a prefill already sending is told to stop. False if the room is not waiting."""
        r = self.rooms.get(room)
        if r is not None and r.client:
            self._finish(r, wire.RouterReply(r.rid, "error", error=error), drain=self._sending(r))
            return True
        p = self.pending.get(room)
        if p is not None and p.client:
            del self.pending[room]
            self.failed.append((p.reg.rid, room, error))
            return True
        return False

    def stats(self) -> dict:
        return {
            "rooms": len(self.rooms),
            "pending": len(self.pending),
            "draining": len(self.draining),
            "free_pages": self.allocator.num_free_pages,
            "num_pages": self.allocator.num_pages,
        }

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()
        for room in list(self.rooms.values()):
            if not room.client:  # the server answers its own requests
                reply = wire.RouterReply(room.rid, "error", error="decode shut down")
                self._send(room.router, reply)
            if room.peer is not None:
                self._send(room.peer, wire.Abort(room.room))
        for p in self.pending.values():
            if not p.client:
                reply = wire.RouterReply(p.reg.rid, "error", error="decode shut down")
                self._send(p.router, reply)
        self.sock.close()
        self._ctx.term()
        self.pool.close()

    # ---- messages ----------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            logger.warning("malformed message of %d frames", len(frames) - 1)
            self._send(frames[0], wire.ErrorReply("one JSON frame per message"))
            return
        ident, frame = frames
        try:
            msg = wire.decode(frame)
        except MessageError as e:
            logger.warning("malformed frame: %s", e)
            reply = wire.RouterReply(e.rid, "error", error=str(e)) if e.rid else None
            self._send(ident, reply or wire.ErrorReply(f"malformed frame: {e}", e.room))
            return
        handler = self._HANDLERS.get(type(msg))
        if handler is None:
            self._send(ident, wire.ErrorReply(f"unexpected {type(msg).__name__} message"))
        else:
            handler(self, ident, msg)

    def _on_register(self, ident: bytes, msg: wire.Register) -> None:
        error = self._queue(msg, ident)
        if error is not None:
            self._send(ident, wire.RouterReply(msg.rid, "error", error=error))

    def _queue(self, reg: wire.Register, router: bytes, client: bool = False) -> str | None:
        """Queue a registration for its pages; why not (None: queued)."""
        r = reg.bootstrap_room
        if r in self.rooms or r in self.draining or r in self.pending:
            return f"room {r} is in use"
        need = cdiv(len(reg.input_ids), self.args.page_size)
        if need > self.allocator.num_pages:
            return f"prompt needs {need} pages, the pool has {self.allocator.num_pages}"
        if len(self.pending) >= self.args.max_queued_registrations:
            return f"{len(self.pending)} registrations already wait for pages"
        deadline = time.monotonic() + self.args.register_timeout
        self.pending[r] = Pending(reg, router, deadline, client)
        self.admit_pending()
        return None

    def admit_pending(self) -> None:
        """Give waiting registrations their pages, in order, while pages are free."""
        while self.pending:
            r, p = next(iter(self.pending.items()))
            pages = self.allocator.alloc_pages(cdiv(len(p.reg.input_ids), self.args.page_size))
            if pages is None:
                return
            del self.pending[r]
            if self.verifier is not None:
                self.verifier.poison(self.pool.kv, self.allocator.slots_of(pages))
            room = Room(p.reg.rid, r, p.router, p.reg.input_ids, pages, client=p.client)
            room.deadline = time.monotonic() + self.args.waiting_timeout
            self.rooms[r] = room

    def _on_bootstrap(self, ident: bytes, msg: wire.Bootstrap) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            self._send(ident, wire.BootstrapReply(msg.room, "unknown", instance=self.instance))
            return
        if room.peer not in (None, ident):
            error = f"room {msg.room} is bound to another prefill"
            self._send(ident, wire.BootstrapReply(msg.room, "error", error=error))
            return
        error = wire.layout_error(msg.kv_layout, msg.kv_dim, self.layout)
        error = error or wire.head_tiling_error(msg.kv_heads, self.layout.num_kv_heads, msg.tp_size)
        error = error or wire.dtype_error(msg.dtype, self.layout.dtype)
        if error is not None:  # another layout, wrong heads or dtype: nothing is written
            logger.warning("room %d refused: %s", msg.room, error)
            self._send(ident, wire.BootstrapReply(msg.room, "error", error=error))
            self._finish(room, wire.RouterReply(room.rid, "error", error=error))
            return
        room.peer = ident
        pages = room.pages.tolist()
        if msg.layerwise:  # each page counts as in once all its layers are
            room.layers = torch.zeros(self._pages_to_send(room), dtype=torch.int64)
        reply = wire.BootstrapReply(
            msg.room, "ready", self._pool_desc, pages, room.prefix_len, instance=self.instance
        )
        self._send(ident, reply)

    def _pages_to_send(self, room: Room) -> int:
        return len(room.pages) - room.prefix_len // self.args.page_size

    def _on_layers_written(self, ident: bytes, msg: wire.LayersWritten) -> None:
        """Pages of a layer-wise room hold their first `layers` layers."""
        room = self.rooms.get(msg.room)
        ours = room is not None and room.peer == ident and msg.instance == self.instance
        if not ours or room.layers is None or room.verifying:
            error = f"room {msg.room} is not receiving layers from this peer in this run"
            self._send(ident, wire.ErrorReply(error, msg.room))
            return
        end = msg.first_page + msg.num_pages
        if end > len(room.layers) or msg.layers > self.layout.num_layers:
            error = (
                f"layers_written of pages [{msg.first_page}, {end}) x {msg.layers} layers:"
                f" the room has {len(room.layers)} pages of {self.layout.num_layers} layers"
            )
            self._fail_transfer(ident, room, error)
            return
        pages = room.layers[msg.first_page : end]
        torch.clamp_min(pages, msg.layers, out=pages)

    def _missing_layers(self, room: Room) -> str | None:
        """Why a layer-wise room's KV is not all in (None: every page has every layer)."""
        if room.layers is None:
            return None
        short = (room.layers < self.layout.num_layers).nonzero().flatten()
        if not len(short):
            return None
        k = int(short[0])
        have = int(room.layers[k])
        return f"page {k} has {have} of {self.layout.num_layers} layers ({len(short)} pages short)"

    def _fail_transfer(self, ident: bytes, room: Room, error: str) -> None:
        self._send(ident, wire.Ack(room.room, False, error, self.instance))
        self._finish(room, wire.RouterReply(room.rid, "error", error=error))

    def _on_transfer_done(self, ident: bytes, msg: wire.TransferDone) -> None:
        room = self.rooms.get(msg.room)
        ours = room is not None and room.peer == ident and msg.instance == self.instance
        if not ours or room.verifying:
            error = f"room {msg.room} is not receiving from this peer in this run"
            self._send(ident, wire.Ack(msg.room, False, error, self.instance))
            return
        expected = self._pages_to_send(room)
        if msg.logprob is not None or msg.top_logprobs is not None:
            room.first_logprob = TokenLogprob(msg.logprob, msg.top_logprobs or [])
        missing = self._missing_layers(room)
        if msg.num_pages != expected:
            self._fail_transfer(ident, room, f"{msg.num_pages} pages arrived, {expected} expected")
        elif missing is not None:
            self._fail_transfer(ident, room, missing)
        elif self.verifier is not None:
            room.verifying = True
            received = self._received_kv(room)
            future = self.verifier.submit(room.input_ids, room.prefix_len, received)
            self._checks.append((room, msg.first_token, future))
        else:
            self._deliver(room, wire.RouterReply(room.rid, "done", msg.first_token))

    def _on_abort(self, ident: bytes, msg: wire.Abort) -> None:
        """From the room's router or its prefill only; to anyone else the room is unknown."""
        r = msg.room
        room = self.rooms.get(r)
        if r in self.draining and self.draining[r][2] == ident:
            self._free(self.draining.pop(r)[0])
        elif room is not None and ident in (room.router, room.peer):
            by_router = ident == room.router and room.peer not in (None, ident)
            why = "the prefill aborted the transfer" if room.client else "aborted"
            reply = wire.RouterReply(room.rid, "error", error=why)
            self._finish(room, reply, drain=by_router)
        elif r in self.pending and self.pending[r].router == ident and not self.pending[r].client:
            p = self.pending.pop(r)
            self._send(p.router, wire.RouterReply(p.reg.rid, "error", error="aborted"))
        else:
            self._send(ident, wire.ErrorReply(f"unknown room {r}", r))

    def _on_ping(self, ident: bytes, msg: wire.Ping) -> None:
        self._send(ident, wire.Pong())

    _HANDLERS = {
        wire.Register: _on_register,
        wire.Bootstrap: _on_bootstrap,
        wire.TransferDone: _on_transfer_done,
        wire.LayersWritten: _on_layers_written,
        wire.Abort: _on_abort,
        wire.Ping: _on_ping,
    }

    # ---- room endings --------------------------------------------------------------------

    def _deliver(self, room: Room, reply: wire.RouterReply) -> None:
        """Answer a room whose KV arrived: now, or once its test delay is over."""
        hold = self.delay.seconds(room.room)
        if hold > 0:
            self._held.append((time.monotonic() + hold, room, reply))
        else:
            self._answer(room, reply)

    def _release_held(self, now: float) -> None:
        # NOTE: every hold is equally long, so the deque is in order of due time.
        while self._held and self._held[0][0] <= now:
            _, room, reply = self._held.popleft()
            if self.rooms.get(room.room) is room:  # not ended while held
                self._answer(room, reply)

    def _answer(self, room: Room, reply: wire.RouterReply) -> None:
        if room.peer is not None:
            self._send(room.peer, wire.Ack(room.room, True, instance=self.instance))
        if room.client and reply.verified is not False:  # its pages go to the server
            self.rooms.pop(room.room, None)
            self.arrived.append((room, reply.first_token))
            return
        if room.client:
            reply = wire.RouterReply(room.rid, "error", error="the KV that arrived failed --verify")
        self._finish(room, msgspec.structs.replace(reply, emitted_at=time.monotonic()))

    def _finish(self, room: Room, reply: wire.RouterReply, drain: bool = False) -> None:
        """Answer the router (the server: `failed`) and free the pages (after the prefill
        confirms, when drain)."""
        self.rooms.pop(room.room, None)
        if not room.client:
            self._send(room.router, reply)
        elif reply.status == "error":
            self.failed.append((room.rid, room.room, reply.error or "failed"))
        if drain:
            self._send(room.peer, wire.Abort(room.room))
            self.draining[room.room] = (room.pages, time.monotonic() + _DRAIN_S, room.peer)
            return
        self._free(room.pages)

    def _free(self, pages: torch.Tensor) -> None:
        """Free a room's pages and give them to the registrations waiting."""
        self.allocator.free(pages * self.args.page_size)
        self.admit_pending()

    def _expire(self, now: float) -> None:
        while self.pending and (p := next(iter(self.pending.values()))).deadline < now:
            del self.pending[p.reg.bootstrap_room]
            error = f"no free receive pages within {self.args.register_timeout:.1f} s"
            if p.client:
                self.failed.append((p.reg.rid, p.reg.bootstrap_room, error))
            else:
                self._send(p.router, wire.RouterReply(p.reg.rid, "error", error=error))
        while self.rooms and (room := next(iter(self.rooms.values()))).deadline < now:
            self._time_out(room)
        while self.draining:
            r, (pages, until, _) = next(iter(self.draining.items()))
            if until >= now:
                break
            del self.draining[r]
            self._free(pages)

    def _time_out(self, room: Room) -> None:
        """The room's KV did not arrive in time: the router gets an error; a prefill still
        sending is told to stop (and the pages wait for it), one waiting for its ack gets a
        refusal."""
        error = f"no KV within {self.args.waiting_timeout:.1f} s"
        if room.peer is not None and room.verifying:
            self._send(room.peer, wire.Ack(room.room, False, error, self.instance))
        reply = wire.RouterReply(room.rid, "error", error=error)
        self._finish(room, reply, drain=self._sending(room))

    @staticmethod
    def _sending(room: Room) -> bool:
        """A prefill bootstrapped the room and may still write its pages."""
        return room.peer is not None and not room.verifying

    def _send(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self.sock.send_multipart([ident, wire.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("could not answer %s: %s", type(msg).__name__, e)

    # ---- verification --------------------------------------------------------------------

    def _received_kv(self, room: Room) -> torch.Tensor:
        """A copy of the room's received KV [2, L, prompt_len, H, D] (a latent pool's
        [1, L, prompt_len, 1, D])."""
        slots = self.allocator.slots_of(room.pages)[: len(room.input_ids)]
        return self.pool.kv.gather(slots)

    def _collect_checks(self) -> None:
        """Answer the rooms whose check finished; each future is asked `done()` once, so a
        check that finishes meanwhile waits for the next tick instead of being lost."""
        running = []
        for room, first_token, future in self._checks:
            if not future.done():
                running.append((room, first_token, future))
            elif self.rooms.get(room.room) is room:  # not aborted meanwhile
                verified, err = _verdict(room, future)
                self._deliver(room, wire.RouterReply(room.rid, "done", first_token, verified, err))
        self._checks = running


def _verdict(room: Room, future: Future) -> tuple[bool, float | None]:
    """(KV close enough, max abs error) of a finished check; a check that raised fails."""
    try:
        return future.result()
    except Exception:
        logger.exception("verification of room %d failed", room.room)
        return False, None
