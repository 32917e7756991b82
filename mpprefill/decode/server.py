"""The decode server: generate requests in, the prompt's KV from a prefill, tokens out.

One process, one thread, one loop over four kinds of socket:

    request socket (--zmq-port)   clients and the HTTP front: the request protocol
                                  (protocol.py): generate, abort, stats
    receiver socket               prefill transfer backends (receiver.py)
    (--receiver-port)
    prefill endpoint links        register_room / room_reply (disagg/bootstrap_server.py)

A generate frame: the receiver allocates the prompt's pages (`add_request`), the room is
registered at the prefill named by `bootstrap_host:bootstrap_port` (without them, a
prefill that sends every room here, `--decode-address`, is assumed), the KV arrives, and
the room's pages and first token go to the Generator. Between two polls of the sockets the
loop runs one decode step over every running sequence (continuous batching: rooms whose KV
came join between steps), so no answer to a prefill waits longer than one step; the
allocator is shared by the receiver and the generator and stays on this one thread.

Replies: `partial` per step for a streamed request (the tokens since its last reply), then
`done` with every token; `error` for a request that cannot finish (bad input, transfer
failed or timed out, abort, no KV pages left).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

import mpprefill.protocol as protocol
from mpprefill import ports
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.delay import TransferDelay
from mpprefill.decode.generate import Generator
from mpprefill.decode.prefill_links import PrefillLinks
from mpprefill.decode.receiver import DecodeReceiver, Room
from mpprefill.decode.verify import load_decode_model
from mpprefill.disagg import wire
from mpprefill.http.child import HttpFrontProcess
from mpprefill.request_socket import RequestSocket
from mpprefill.sampling.token_logprob import UNKNOWN, TokenLogprob

logger = logging.getLogger(__name__)
MAX_FRAMES_PER_POLL = protocol.REQUEST_HWM


def _control_refusal(msg: protocol.FlushCache | protocol.StartProfile | protocol.StopProfile):
    """The reply to a control message: a decode server holds no prefix cache to flush (a
    success, as sglang-router's fan-out of /flush_cache needs) and does not profile."""
    if isinstance(msg, protocol.FlushCache):
        return protocol.control_reply(msg.rid, "flush_cache", True, "no prefix cache to flush")
    kind = "start_profile" if isinstance(msg, protocol.StartProfile) else "stop_profile"
    return protocol.control_reply(msg.rid, kind, False, "a decode server does not profile")


def _refusal_code(why: str) -> int | None:
    """The status of a refused request (None: a front reads it from the reason)."""
    if why.startswith(("bad input", "duplicate rid", "room ", "prompt needs")):
        return protocol.Code.BAD_REQUEST
    if why == "overloaded" or why.endswith("registrations already wait for pages"):
        return protocol.Code.OVERLOADED
    if why == "decode shut down" or why.startswith("this decode server does not generate"):
        return protocol.Code.UNAVAILABLE
    return None


@dataclass(slots=True, eq=False)
class Request:
    msg: protocol.Generate
    owner: bytes  # the client that sent it: its replies go there, only it may abort
    endpoint: str | None  # the prefill's bootstrap endpoint, host:port
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with return_logprob
    generating: bool = False  # its KV came; the generator has it
    code: int | None = None  # its error reply's status: the prefill's, when it refused the room


def eos_token_ids(model_path: str | None) -> tuple[int, ...]:
    """`eos_token_id` (an int or a list) of the model dir's generation_config.json and
    config.json, together; none for the built-in model."""
    if model_path is None:
        return ()
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and not isinstance(t, bool):
                ids.add(t)
    return tuple(sorted(ids))


class DecodeServer:
    def __init__(self, args: DecodeArgs, delay: TransferDelay | None = None) -> None:
        """`delay` (a test hook): hold finished rooms' answers a while (decode/delay.py)."""
        self.args = args
        # NOTE: the ports first: one that cannot be had fails here, before the model loads.
        ports.check_free(args.binds)
        self.front: HttpFrontProcess | None = None
        self.model = None if args.emulate_model is not None else load_decode_model(args)
        with ports.binding(args.host, args.receiver_listen):
            self.rx = DecodeReceiver(args, delay=delay, model=self.model)
        self.generator = None
        if self.model is not None:
            self.generator = Generator(
                self.model,
                self.rx.pool.kv,
                self.rx.allocator,
                eos_token_ids(args.model_path),
                args.max_running_requests,
            )
        self.requests: dict[str, Request] = {}  # by rid, until replied
        self.by_room: dict[int, str] = {}  # rooms of requests still waiting for their KV
        self._stop = threading.Event()
        self._closing: str | None = None
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        try:
            with ports.binding(args.zmq_host, args.zmq_listen):
                self.clients = RequestSocket(self.ctx, args.zmq_host, args.zmq_listen.port)
        except ports.PortUnavailable:
            self.rx.close()
            self.ctx.term()
            raise
        self.zmq_port = self.clients.port
        own = f"{args.advertised_host}:{self.rx.port}"
        self.links = PrefillLinks(self.ctx, self.poller, own)
        self.poller.register(self.clients.sock, zmq.POLLIN)
        self.poller.register(self.rx.sock, zmq.POLLIN)
        if args.http_listen is not None:
            self._start_front()
        logger.info(
            "decode server: requests on %s:%d, receiver on %s, %s",
            args.zmq_host,
            self.zmq_port,
            own,
            "generating" if self.generator is not None else "receiving only",
        )

    def _start_front(self) -> None:
        """The HTTP front, on the port bound here; a port taken since the check at the
        start closes what started."""
        listener = ports.listen_or_close(self.args.host, self.args.http_listen, self.close)
        self.front = HttpFrontProcess(self.args, self.zmq_port, listener)

    # ---- loop ----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            self.step()

    def step(self) -> None:
        """Read every socket, hand over what ended, then one decode step if any runs."""
        timeout = 0 if self._generating() else (10 if self.rx.busy else 100)
        events = dict(self.poller.poll(timeout))
        if self.rx.sock in events:
            self.rx.read()
        self.rx.tick()
        self._collect()  # first: an abort read below finds its request generating or not
        if self.clients.sock in events:
            self._read_requests()
        for endpoint, reply in self.links.read(events):
            self._on_room_reply(endpoint, reply)
        self._collect()
        if self._generating():
            for out in self.generator.step():
                self._on_output(out)
            self.rx.admit_pending()  # pages of finished sequences are free again
        self.links.close_idle(time.monotonic())

    def _generating(self) -> bool:
        gen = self.generator
        return gen is not None and bool(gen.num_running or gen.num_waiting)

    def stop(self) -> None:
        """Ask `serve_forever` to return (safe from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        """Every request gets an error; the receiver tells the prefills sending to stop."""
        self._closing = "decode shut down"
        for rid in list(self.requests):
            self._fail(rid, self._closing)
        if self.generator is not None:
            self.generator.close()
        self.rx.close()
        self.links.close()
        self.clients.close()
        self.ctx.term()
        if self.front is not None:
            self.front.stop()

    # ---- requests ------------------------------------------------------------------------

    def _read_requests(self) -> None:
        for ident, msg in self.clients.read(MAX_FRAMES_PER_POLL)[1]:
            self._handle(ident, msg)

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, protocol.Stats):
            self._send(ident, protocol.stats_reply(msg.rid, self.stats()))
        elif isinstance(msg, protocol.Abort):
            self._abort(ident, msg.rid)
        elif isinstance(msg, protocol.Generate):
            self._admit(ident, msg)
        else:
            self._send(ident, _control_refusal(msg))

    def _admit(self, ident: bytes, msg: protocol.Generate) -> None:
        why = self._refusal(msg)
        if why is None:
            why = self.rx.add_request(msg.rid, msg.bootstrap_room, msg.input_ids)
        if why is not None:
            self._send(ident, protocol.error_reply(msg.rid, why, _refusal_code(why)))
            return
        endpoint = None
        if msg.bootstrap_host is not None:
            endpoint = f"{msg.bootstrap_host}:{msg.bootstrap_port}"
        self.requests[msg.rid] = Request(msg, ident, endpoint)
        self.by_room[msg.bootstrap_room] = msg.rid
        if endpoint is not None:
            why = self.links.register(endpoint, msg.bootstrap_room)
            if why is not None:  # its reply comes from the receiver's `failed`
                self.rx.end_request(msg.bootstrap_room, why)

    def _refusal(self, msg: protocol.Generate) -> str | None:
        """Why this server will not take the request (None: it will)."""
        if self._closing is not None:
            return self._closing
        if self.generator is None:
            return "this decode server does not generate (its pool is for --emulate-model)"
        if msg.rid in self.requests:
            return "duplicate rid while the first is live"
        if len(self.requests) >= self.args.max_queued_registrations:
            return "overloaded"
        if msg.bootstrap_room is None:
            return "bad input: a decode request needs a bootstrap_room"
        if (msg.bootstrap_host is None) != (msg.bootstrap_port is None):
            return "bad input: bootstrap_host and bootstrap_port go together"
        if msg.bootstrap_host is not None:
            try:
                wire.check_address(f"{msg.bootstrap_host}:{msg.bootstrap_port}")
            except ValueError as e:
                return f"bad input: bootstrap endpoint: {e}"
        return self._check_prompt(msg)

    def _check_prompt(self, msg: protocol.Generate) -> str | None:
        config = self.model.config
        n = len(msg.input_ids)
        if n == 0:
            return "bad input: empty input_ids"
        if max(msg.input_ids) >= config.vocab_size or min(msg.input_ids) < 0:
            return f"bad input: token ids must be in [0, {config.vocab_size}) (vocabulary)"
        limit = config.max_position_embeddings
        if n + msg.sampling_params.max_new_tokens > limit:
            new = msg.sampling_params.max_new_tokens
            return f"bad input: {n} prompt + {new} new tokens exceed the context length {limit}"
        return None

    def _abort(self, ident: bytes, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.owner != ident:  # another client's request is unknown here
            self._send(ident, protocol.error_reply(rid, "unknown rid"))
        elif req.generating:
            self.generator.abort(rid)
            self._fail(rid, "aborted by client")
        else:  # its reply comes from the receiver's `failed`
            self.rx.end_request(req.msg.bootstrap_room, "aborted by client")

    def _on_room_reply(self, endpoint: str, reply: wire.RoomReply) -> None:
        rid = self.by_room.get(reply.room)
        req = self.requests.get(rid) if rid is not None else None
        if req is None or req.endpoint != endpoint or reply.ok:
            return
        why = f"bootstrap refused by the prefill at {endpoint}: {reply.error}"
        if self.rx.end_request(reply.room, why):  # its reply comes from the receiver's `failed`
            req.code = reply.code

    # ---- rooms that ended, and generation -------------------------------------------------

    def _collect(self) -> None:
        arrived, self.rx.arrived = self.rx.arrived, []
        failed, self.rx.failed = self.rx.failed, []
        for rid, _room, error in failed:
            self._fail(rid, error)
        for room, first_token in arrived:
            self._start(room, first_token)

    def _start(self, room: Room, first_token: int) -> None:
        req = self.requests.get(room.rid)
        if req is None:  # cannot happen: a request leaves only with its room
            self.rx.allocator.free(room.pages * self.args.page_size)
            return
        self._waited(req)
        msg = req.msg
        try:
            out = self.generator.add(
                msg.rid,
                msg.input_ids,
                room.pages,
                first_token,
                msg.sampling_params,
                room.first_logprob,
            )
        except ValueError as e:
            self.rx.allocator.free(room.pages * self.args.page_size)
            self._fail(msg.rid, f"bad input: {e}")
            return
        req.generating = True
        if out is not None:
            self._on_output(out)
            return
        req.output_ids.append(first_token)
        first = [room.first_logprob or UNKNOWN] if msg.sampling_params.return_logprob else None
        if first is not None:
            req.logprobs.extend(first)
        if msg.stream:
            self._send(req.owner, self._partial(req, [first_token], first))

    def _partial(self, req: Request, tokens: list[int], logprobs) -> bytes:
        top = req.msg.sampling_params.num_top_logprobs > 0
        return protocol.partial_reply(req.msg.rid, tokens, logprobs, top)

    def _on_output(self, out) -> None:
        req = self.requests.get(out.key)
        if req is None:
            return
        req.output_ids.extend(out.new_tokens)
        if out.logprobs is not None:
            req.logprobs.extend(out.logprobs)
        if not out.finished:
            if req.msg.stream:
                self._send(req.owner, self._partial(req, out.new_tokens, out.logprobs))
            return
        reason = out.finish_reason or {}
        if reason.get("type") == "abort":
            self._fail(req.msg.rid, reason.get("message", "aborted"))
            return
        del self.requests[req.msg.rid]
        msg = req.msg
        n = len(msg.input_ids)
        first = req.output_ids[0]
        params = msg.sampling_params
        logprobs = req.logprobs if params.return_logprob else None
        top = params.num_top_logprobs > 0
        reply = protocol.done_reply(
            msg.rid, first, n, 0, req.output_ids, out.finish_reason, logprobs, top
        )
        self._send(req.owner, reply)

    def _fail(self, rid: str, error: str) -> None:
        """Reply `error`: the request's room has ended in the receiver, or its sequence in
        the generator, already."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if not req.generating and req.endpoint is not None:
            self.links.withdraw(req.endpoint, req.msg.bootstrap_room)
        self._waited(req)
        self._send(req.owner, protocol.error_reply(rid, error, req.code))

    def _waited(self, req: Request) -> None:
        """The request's room waits no more (its KV came, or it ended)."""
        room = req.msg.bootstrap_room
        if self.by_room.get(room) == req.msg.rid:
            del self.by_room[room]
        if req.endpoint is not None:
            self.links.done(req.endpoint, room)

    def stats(self) -> dict:
        gen = self.generator
        rx = self.rx.stats()
        return {
            "role": "decode",
            "disaggregation_mode": "decode",
            "tp_size": 1,
            "max_total_num_tokens": rx["num_pages"] * self.args.page_size,
            "context_length": self._context_length(),
            "requests": len(self.requests),
            "running": gen.num_running if gen is not None else 0,
            "waiting": gen.num_waiting if gen is not None else 0,
            "load": self._load(rx),
            "counters": self.clients.counters(),
            **rx,
        }

    def _context_length(self) -> int | None:
        """The longest prompt plus output a request may have (None: not generating)."""
        return self.model.config.max_position_embeddings if self.model is not None else None

    def _load(self, rx: dict) -> dict[str, int]:
        """SGLang's load figures: every request not yet replied to, those of them waiting
        for their KV or for a place in the decode batch, and the KV tokens held."""
        gen = self.generator
        waiting = sum(1 for r in self.requests.values() if not r.generating)
        waiting += gen.num_waiting if gen is not None else 0
        held = (rx["num_pages"] - rx["free_pages"]) * self.args.page_size
        return {"num_reqs": len(self.requests), "num_waiting_reqs": waiting, "num_tokens": held}

    def _send(self, ident: bytes, payload: bytes) -> None:
        self.clients.send(ident, payload)
