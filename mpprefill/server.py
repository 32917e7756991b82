"""`mpprefill serve`: the prefill scheduler behind a ZeroMQ ROUTER, with its worker."""

from __future__ import annotations

import json
import logging
import os
import signal
import time

import zmq

import ipc
from mpprefill import protocol
from mpprefill.config import ServerArgs
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer
from mpprefill.worker.base import WorkerDied
from mpprefill.worker.factory import make_worker

logger = logging.getLogger(__name__)
MAX_FRAMES_PER_POLL = 256


class PrefillServer:
    def __init__(self, args: ServerArgs):
        self.args, self.mode = args, args.resolved_forward_mode
        if args.trace_dir:
            set_tracer(Tracer("scheduler", enabled=True))
        self.worker, model_config = make_worker(args, self.mode)
        self.transfer = _make_transfer(args, self.worker.kv_cache)
        self.scheduler = Scheduler(
            args, model_config, self.worker, self.transfer, on_finish=self._reply
        )
        self.scheduler.recv_requests = self._recv
        self.scheduler.wait_for_requests = self._wait
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        self.sock.bind(f"tcp://{args.host}:{args.port}")
        if args.record_batches:
            self.scheduler.metrics.batch_shapes = []
        self._owner: dict[str, bytes] = {}
        self._stop = False
        self.exit_code = 0

    # ---- socket side ---------------------------------------------------------------------

    def _recv(self) -> list[Req]:
        reqs = []
        for _ in range(MAX_FRAMES_PER_POLL):
            try:
                parts = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(parts) != 2:
                logger.warning("dropping a message of %d parts", len(parts))
                continue
            req = self._handle(parts[0], parts[1])
            if req is not None:
                reqs.append(req)
        return reqs

    def _handle(self, ident: bytes, frame: bytes) -> Req | None:
        try:
            msg = protocol.parse_frame(frame)
        except protocol.ProtocolError as e:
            logger.info("bad frame: %s", e)
            self._send(ident, protocol.error_reply(e.rid, str(e)))
            return None
        if isinstance(msg, protocol.Stats):
            self._send(ident, json.dumps({"status": "stats", **self.stats()}).encode())
        elif isinstance(msg, protocol.Abort):
            if not self.scheduler.abort(msg.rid, "aborted by client"):
                self._send(ident, protocol.error_reply(msg.rid, "unknown rid"))
        else:
            return self._admit(ident, msg)
        return None

    def _admit(self, ident: bytes, msg: protocol.Generate) -> Req | None:
        s = self.scheduler
        if msg.rid in s.live or msg.rid in self._owner:
            self._send(
                ident, protocol.error_reply(msg.rid, "duplicate rid while the first is live")
            )
            return None
        if len(s.live) + len(s.incoming) >= self.args.max_queued_requests:
            self._send(ident, protocol.error_reply(msg.rid, "overloaded"))
            return None
        self._owner[msg.rid] = ident
        return Req(msg.rid, msg.input_ids, msg.sampling_params, msg.bootstrap_room)

    def _reply(self, req: Req) -> None:
        ident = self._owner.pop(req.rid, None)
        if ident is None:
            return
        if req.error:
            self._send(ident, protocol.error_reply(req.rid, req.error))
        else:
            self._send(
                ident,
                protocol.done_reply(req.rid, req.first_token, req.prompt_len, req.cached_tokens),
            )

    def _send(self, ident: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart([ident, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or its queue full: the reply is dropped
            logger.warning("could not reply to a client: %s", e)

    def _wait(self, timeout: float) -> None:
        self.sock.poll(max(1, int(timeout * 1000)))

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "forward_mode": self.mode,
            "queues": {
                "bootstrap": len(s.bootstrap_queue),
                "waiting": len(s.waiting),
                "inflight": len(s.inflight_queue),
                "live": len(s.live),
            },
            "kv": {
                "free_tokens": s.allocator.available_size(),
                "total_tokens": s.allocator.size,
                "cached_tokens": s.tree.total_size(),
            },
            "req_slots": {"free": s.req_pool.available_size(), "total": s.req_pool.size},
            "counters": s.metrics.to_dict(),
            "invariants": self._check_invariants(),
        }

    def _check_invariants(self) -> dict:
        """With --check-invariants, DESIGN.md's drained-state checks whenever idle."""
        from mpprefill.scheduling.invariants import InvariantError, check_drained

        s = self.scheduler
        if not self.args.check_invariants or s.live or s.forwards_in_flight:
            return {"checked": False}
        try:
            check_drained(s)
        except (InvariantError, AssertionError) as e:
            return {"checked": True, "ok": False, "error": str(e)}
        return {"checked": True, "ok": True}

    # ---- lifecycle -----------------------------------------------------------------------

    def serve_forever(self) -> int:
        self._install_signals()
        logger.info(
            "prefill server on %s:%d, forward mode %s, transfer %s",
            self.args.host,
            self.args.port,
            self.mode,
            self.transfer.name,
        )
        try:
            LOOPS[self.mode](self.scheduler, lambda: self._stop)
        except WorkerDied as e:
            logger.error("forward worker failed: %s", e)
            self.scheduler.fail_all(f"worker failure: {e}")
            self.exit_code = 1
        else:
            self.scheduler.fail_all("server shutting down")
        finally:
            self.close()
        return self.exit_code

    def _install_signals(self) -> None:
        def on_signal(signum, frame):
            if self._stop:  # second signal: leave now, still unlinking
                self.worker.close()
                ipc.unlink_owned()
                os._exit(1)
            logger.info("signal %d: shutting down", signum)
            self._stop = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    def close(self) -> None:
        t0 = time.monotonic()
        if self.args.trace_dir:
            get_tracer().dump(_trace_dir(self.args.trace_dir))
        if self.args.record_batches:
            with open(self.args.record_batches, "w") as f:
                json.dump(self.scheduler.metrics.batch_shapes, f)
        self.sock.close(linger=1000)
        self.transfer.close()
        self.worker.close()
        self.ctx.term()
        logger.info("server closed in %.2fs", time.monotonic() - t0)


def _make_transfer(args: ServerArgs, kv):
    from mpprefill.disagg.backends import make_transfer

    return make_transfer(
        args.disaggregation_transfer_backend,
        kv,
        args.page_size,
        args.decode_address,
        bootstrap_timeout=args.bootstrap_timeout,
    )


def _trace_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def run_serve(args: ServerArgs) -> int:
    return PrefillServer(args).serve_forever()
