"""`mpprefill serve`: the prefill scheduler behind a ZeroMQ ROUTER (`--zmq-port`), with its
worker, and the HTTP front process on `--port` (`mpprefill.http.child`; `--disable-http-front`
for the socket alone).

Socket limits and frame sizes: protocol.py; signals: signals.py. Every request read from
the socket gets exactly one reply, at shutdown too: a transfer the decode side never
answers fails by its sender's deadline, and a dead worker is noticed, busy or idle.
Only the client that sent a generate (its ROUTER identity) may abort it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import zmq

import mpprefill.protocol as protocol
from mpprefill import ports
from mpprefill.config import ServerArgs
from mpprefill.disagg.sender import TransferDied
from mpprefill.http.child import HttpFrontProcess
from mpprefill.protocol import ABORTED, UNKNOWN_RID, Code
from mpprefill.request_socket import RequestSocket
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.scheduling.stats import scheduler_stats
from mpprefill.server import signals
from mpprefill.server.runtime_profiler import RuntimeProfiler
from mpprefill.trace.gc import GcWatch, freeze_heap
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer
from mpprefill.worker.api import WorkerDied
from mpprefill.worker.factory import make_worker

logger = logging.getLogger(__name__)
MAX_FRAMES_PER_POLL = protocol.REQUEST_HWM
# Bytes one poll reads before the scheduler validates what it read (one frame may cross it).
MAX_BYTES_PER_POLL = protocol.MAX_FRAME_BYTES


class PrefillServer:
    def __init__(self, args: ServerArgs):
        self.args, self.mode = args, args.mode
        self._stop = False
        self.worker = None
        self.front: HttpFrontProcess | None = None
        self.profiler: RuntimeProfiler | None = None
        self.t_start = time.monotonic()
        # NOTE: the ports first: one that cannot be had fails here, before a worker starts.
        ports.check_free(args.binds)
        self.ctx = zmq.Context()
        with ports.binding(args.zmq_host, args.zmq_listen):
            self.clients = RequestSocket(self.ctx, args.zmq_host, args.zmq_listen.port)
        signals.install(self._on_signal, self._exit_now)
        if args.trace_dir:
            set_tracer(Tracer("scheduler", enabled=True))
        self.worker, model_config = make_worker(args, self.mode)
        try:
            with ports.binding(args.host, args.bootstrap_listen):
                self.transfer = _make_transfer(args, self.worker)
        except ports.PortUnavailable:  # taken since the check above
            self.worker.close()
            self.clients.close(linger_ms=0)
            self.ctx.term()
            raise
        self.scheduler = Scheduler(
            args,
            model_config,
            self.worker,
            self.transfer,
            on_finish=self._reply,
            recv_requests=self._recv,
            wait_for_requests=self._wait,
        )
        self._poller = zmq.Poller()  # the socket, and the worker's death where it has one
        self._poller.register(self.clients.sock, zmq.POLLIN)
        if self.worker.sentinel is not None:
            self._poller.register(self.worker.sentinel, zmq.POLLIN)
        if args.record_batches:
            self.scheduler.metrics.batch_shapes = []
        self._owner: dict[str, bytes] = {}  # rid -> client identity, until replied
        self._arriving: dict[str, Req] = {}  # admitted by this _recv, not yet ingested
        self._aborted: set[str] = set()  # rids their client aborted, until replied
        self._closing: str | None = None  # once set, every new request gets it as its error
        self._closing_code = Code.UNAVAILABLE
        self.exit_code = 0
        self.gc = GcWatch().install()
        forward_pid = self.worker.pid if self.mode.in_process else None
        self.profiler = RuntimeProfiler(forward_pid)
        if args.http_listen is not None:
            self._start_front()

    def _start_front(self) -> None:
        """The HTTP front, on the port bound here; a port taken since the check at the
        start closes what started."""
        listener = ports.listen_or_close(self.args.host, self.args.http_listen, self.close)
        self.front = HttpFrontProcess(self.args, self.args.zmq_listen.port, listener)

    # ---- socket side ---------------------------------------------------------------------

    def _recv(self) -> list[Req]:
        self._check_worker()
        self.profiler.poll(self.scheduler.metrics.num_batches)
        self._read_frames()
        reqs, self._arriving = list(self._arriving.values()), {}
        return reqs

    def _read_frames(self) -> int:
        """Handle frames until the socket is empty or one poll's frames or bytes are read."""
        n, got = self.clients.read(MAX_FRAMES_PER_POLL, MAX_BYTES_PER_POLL)
        for ident, msg in got:
            self._handle(ident, msg)
        return n

    def _check_worker(self) -> None:
        """WorkerDied once the worker is gone, whether or not a forward is in flight."""
        death = self.worker.death()
        if death is not None:
            raise WorkerDied(death)

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, protocol.Generate):
            self._admit(ident, msg)
        elif isinstance(msg, protocol.Stats):
            self._send(ident, protocol.stats_reply(msg.rid, self.stats()))
        elif isinstance(msg, protocol.Abort):
            self._abort(ident, msg.rid)
        elif isinstance(msg, protocol.FlushCache):
            ok, why, extra = self._flush_cache()
            self._send(ident, protocol.control_reply(msg.rid, "flush_cache", ok, why, **extra))
        elif isinstance(msg, protocol.StartProfile):
            ok, why = self.profiler.start(msg, self.scheduler.metrics.num_batches)
            self._send(ident, protocol.control_reply(msg.rid, "start_profile", ok, why))
        elif isinstance(msg, protocol.StopProfile):
            ok, why, files = self.profiler.stop()
            reply = protocol.control_reply(msg.rid, "stop_profile", ok, why, files=files)
            self._send(ident, reply)

    def _abort(self, ident: bytes, rid: str) -> None:
        if self._owner.get(rid) != ident:  # another client's request is unknown to this one
            self._send(ident, protocol.error_reply(rid, UNKNOWN_RID, Code.UNKNOWN_RID))
            return
        req = self._arriving.pop(rid, None)
        if req is not None:  # arrived in this same poll: never reached the scheduler
            self._aborted.add(rid)
            req.error = ABORTED
            self._reply(req)
        elif rid in self.scheduler.reqs.live:
            self._aborted.add(rid)
            self.scheduler.metrics.note_abort(rid)
            self.scheduler.reqs.abort(rid, ABORTED)
        else:
            self._send(ident, protocol.error_reply(rid, UNKNOWN_RID, Code.UNKNOWN_RID))

    def _admit(self, ident: bytes, msg: protocol.Generate) -> None:
        reqs = self.scheduler.reqs
        if self._closing is not None:
            self._send(ident, protocol.error_reply(msg.rid, self._closing, self._closing_code))
        elif msg.rid in reqs.live or msg.rid in self._owner:
            self._refuse(ident, msg, "duplicate rid while the first is live", Code.BAD_REQUEST)
        elif self._queued() >= self.args.max_queued_requests:
            self._refuse(ident, msg, "overloaded", Code.OVERLOADED)
        else:
            self._owner[msg.rid] = ident
            req = Req(msg.rid, msg.input_ids, msg.sampling_params, msg.bootstrap_room)
            self._arriving[msg.rid] = req

    def _refuse(self, ident: bytes, msg: protocol.Generate, why: str, code: int) -> None:
        """An error reply for a request never made live; its room's decode side hears of
        it through the bootstrap endpoint."""
        if msg.bootstrap_room is not None:
            self.transfer.refuse(msg.bootstrap_room, why, code)
        self._send(ident, protocol.error_reply(msg.rid, why, code))

    def _queued(self) -> int:
        reqs = self.scheduler.reqs
        return len(reqs.live) + len(reqs.incoming) + len(self._arriving)

    def _reply(self, req: Req) -> None:
        ident = self._owner.pop(req.rid, None)
        aborted = req.rid in self._aborted
        self._aborted.discard(req.rid)
        code = None
        if req.error:
            code = Code.ABORTED if aborted else self._error_code(req)
        if req.error and req.sender is None and req.bootstrap_room is not None:
            self.transfer.refuse(req.bootstrap_room, req.error, code)  # refused, or aborted early
        if ident is None:
            return
        if req.error:
            self._send(ident, protocol.error_reply(req.rid, req.error, code))
        else:
            params = req.sampling_params
            logprobs = req.output_logprobs if params.return_logprob else None
            reply = protocol.done_reply(
                req.rid,
                req.first_token,
                req.prompt_len,
                req.cached_tokens,
                logprobs=logprobs,
                top_logprobs=params.num_top_logprobs > 0,
            )
            self._send(ident, reply)

    def _error_code(self, req: Req) -> int:
        """The status of a request the scheduler failed."""
        if self._closing is not None:
            return self._closing_code
        # NOTE: a request gets its KV sender only once Scheduler.validate accepted it.
        if req.sender is None:
            return Code.BAD_REQUEST
        return Code.INTERNAL

    def _flush_cache(self) -> tuple[bool, str, dict]:
        """SGLang's flush: the prefix cache (and the host tier under it) is dropped only
        while no request is live; the tokens dropped per tier."""
        s = self.scheduler
        busy = self._queued()
        if busy or s.forwards_in_flight or s.reqs.chunked_req is not None:
            return False, f"cache not flushed: {busy} requests are not finished", {}
        flushed = s.flush_caches()
        why = f"cache flushed: {flushed.device} tokens on the device"
        if flushed.host is not None:
            why += f", {flushed.host} on the host"
        logger.info(why)
        return True, why, {"flushed_tokens": flushed._asdict()}

    def _send(self, ident: bytes, payload: bytes) -> None:
        self.clients.send(ident, payload)

    def _wait(self, timeout: float) -> None:
        """Until a frame arrives, the worker dies (`_recv` then raises) or `timeout` passes."""
        self._poller.poll(max(1, int(timeout * 1000)))

    def stats(self) -> dict:
        args = self.args
        out = {
            "forward_mode": self.mode.name,
            "disaggregation_mode": args.disaggregation_mode,
            "tp_size": args.tp_size,
            "max_total_num_tokens": self.scheduler.allocator.size,
            "context_length": self.scheduler.context_len,
            **scheduler_stats(self.scheduler),
        }
        out["uptime_s"] = time.monotonic() - self.t_start
        out["counters"] |= self.clients.counters()
        out["gc"] = self.gc.to_dict()
        return out

    # ---- lifecycle -----------------------------------------------------------------------

    def serve_forever(self) -> int:
        logger.info(
            "prefill server on %s:%d (ZeroMQ), forward mode %s, transfer %s",
            self.args.zmq_host,
            self.args.zmq_listen.port,
            self.mode.name,
            self.transfer.name,
        )
        if not self.args.disable_gc_freeze:
            logger.info("froze %d objects of the started heap", freeze_heap())
        reason = "server shutting down"
        try:
            LOOPS[self.mode.name](self.scheduler, lambda: self._stop)
        except WorkerDied as e:
            logger.error("forward worker failed: %s", e)
            reason, self.exit_code = f"worker failure: {e}", 1
            self.worker.kill_now()  # a stalled process would not answer a graceful exit
        except TransferDied as e:
            logger.error("KV transfer failed: %s", e)
            reason, self.exit_code = f"transfer failure: {e}", 1
        except Exception:
            logger.exception("the scheduler loop failed")
            reason, self.exit_code = "internal server error", 1
        finally:
            if self.exit_code:
                self._closing_code = Code.INTERNAL
            try:
                self._answer_all(reason)
            finally:
                self.close()
        return self.exit_code

    def _answer_all(self, reason: str, max_frames: int = 1 << 16) -> None:
        """Every request live, read but not yet live, or already sent to the socket gets
        `reason` as its error.

        NOTE: frames still in kernel buffers reach the ZeroMQ queue in pieces of
        REQUEST_HWM; a short quiet poll tells "drained" from "not yet refilled".
        """
        self._closing = reason
        while max_frames > 0:
            n = self._read_frames()
            if n == 0 and not self.clients.sock.poll(50):
                break
            max_frames -= max(n, 1)
        self.scheduler.reqs.fail_all(reason)
        for rid, ident in list(self._owner.items()):  # read, never made live (a failed loop)
            del self._owner[rid]
            self._send(ident, protocol.error_reply(rid, reason, self._closing_code))

    def _on_signal(self, signum: int) -> None:
        logger.info("signal %d: shutting down", signum)
        self._stop = True

    def _exit_now(self) -> None:
        if self.front is not None:
            self.front.kill()
        if self.worker is not None:
            if self.profiler is not None:
                self.profiler.forget_forward_process()
            self.worker.kill_now()

    def close(self) -> None:
        t0 = time.monotonic()
        if self.front is not None:
            self.front.stop()
        if self.profiler.active is not None:
            logger.info("profile stopped at shutdown: %s", self.profiler.stop()[1])
        if self.args.trace_dir:
            os.makedirs(self.args.trace_dir, exist_ok=True)
            get_tracer().dump(self.args.trace_dir)
        if self.args.record_batches:
            with open(self.args.record_batches, "w") as f:
                json.dump(self.scheduler.metrics.batch_shapes, f)
        self.clients.close()
        self.transfer.close()
        if self.scheduler.host_tier is not None:
            self.scheduler.host_tier.close()
        self.worker.close()
        self.ctx.term()
        logger.info("server closed in %.2fs", time.monotonic() - t0)


def _make_transfer(args: ServerArgs, worker):
    """The KV pools (one per tensor-parallel rank) are opened only when pages really move
    (with pinned staging on a GPU this keeps the scheduler free of CUDA); sends wait on the
    worker's KV write fence, layer-wise sends on its per-layer counter."""
    from mpprefill.disagg.backends import make_transfer
    from mpprefill.emulation.setup import transfer_link_for

    backend = args.disaggregation_transfer_backend
    kv = worker.kv_shards() if backend != "fake" else None
    return make_transfer(
        backend,
        kv,
        args.page_size,
        args.decode_address,
        bootstrap_timeout=args.bootstrap_timeout,
        transfer_timeout=args.transfer_timeout,
        fence=worker.kv_fence,
        bootstrap_host=args.host,
        bootstrap_port=args.bootstrap_listen.port,
        layers=worker.layer_progress if args.disaggregation_layerwise_send else None,
        link=transfer_link_for(args.link_config(), args.worker_device),
    )


def run_serve(args: ServerArgs) -> int:
    # NOTE: one interval for the scheduler's threads (a forward thread's modes) and, through
    # its args, the forward process's, so no mode runs on a GIL tuned for it alone.
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    return PrefillServer(args).serve_forever()
