"""The HTTP front's routes (FastAPI): SGLang's endpoints over one SchedulerLink.

Each route parses its body here, off the scheduler's process; the scheduler sees only the
protocol's frames. Errors are HTTP status codes with `{"error": {"message", "code"}}`
bodies (errors.py); a body over `--max-body-bytes` gets 413 before any of it is parsed,
and a text longer in characters than the context could hold gets 400 before it is
tokenized (bodies.check_text_lengths; tokenizing runs on a thread, off the event loop).
`/metrics` is metrics.py; `/flush_cache` and the profiling routes are the protocol's
control messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from mpprefill.http import bodies
from mpprefill.http.args import HttpArgs
from mpprefill.http.auth import require_api_key
from mpprefill.http.chat_template import ChatTemplate
from mpprefill.http.errors import HttpError, bad_request, error_body
from mpprefill.http.link import FrameTooLarge, NoReply, RidInFlight, SchedulerLink
from mpprefill.http.metrics import FrontMetrics
from mpprefill.http.openai_serving import OpenAIServing
from mpprefill.http.outputs import Delta, Output
from mpprefill.http.responses import (
    ClientGone,
    FastJSONResponse,
    error_event,
    free_big_buffers_to_the_os,
    read_json,
    sse,
    until_disconnect,
)
from mpprefill.http.tokenizer import TextTokenizer
from mpprefill.version import package_version

logger = logging.getLogger(__name__)
# what /server_info takes from the server's stats to its top level, as SGLang puts them
SERVER_INFO_FIELDS = ("disaggregation_mode", "tp_size", "max_total_num_tokens", "context_length")


class HttpFront:
    """The routes' state: the settings, the tokenizer (None: ids only) and the link."""

    def __init__(self, args: HttpArgs, tokenizer: TextTokenizer | None):
        self.args = args
        self.tokenizer = tokenizer
        self.link: SchedulerLink | None = None
        self.metrics = FrontMetrics(args.model_path or "default")
        self._context_length: int | None = None

    async def read_body(self, request: Request) -> Any:
        return await read_json(request, self.args.max_body_bytes)

    async def context_length(self) -> int:
        """The longest prompt plus output the server takes, as its stats say (asked once)."""
        if self._context_length is None:
            stats = await self._stats()
            if not isinstance(stats.get("context_length"), int):  # a decode that emulates
                raise HttpError(503, "the server does not generate: its stats give no context")
            self._context_length = stats["context_length"]
        return self._context_length

    async def start(self) -> None:
        free_big_buffers_to_the_os()
        self.link = SchedulerLink(self.args.zmq_address)
        self.link.start()

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()

    # ---- /generate -----------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = bodies.parse_generate(await read_json(request, self.args.max_body_bytes))
        items = body.items
        if any(it.text is not None for it in items):
            context = await self.context_length() if self.tokenizer is not None else None
            items = await asyncio.to_thread(bodies.tokenize, items, self.tokenizer, context)
        if body.stream:
            events = self._events(items, body.batch, t0)
            return StreamingResponse(events, media_type="text/event-stream")
        replies = await until_disconnect(request, self._generate_all(items, t0))
        return FastJSONResponse(replies if body.batch else replies[0])

    async def _generate_all(self, items: list[bodies.GenerateItem], t0: float) -> list[dict]:
        """Every prompt's body in order; a batch with a failed prompt fails with the first."""
        results = await self.run_all(items, t0)
        return [bodies.generate_body(r.item, r.output, r.meta, self.tokenizer) for r in results]

    async def run_all(self, items: list[bodies.GenerateItem], t0: float) -> list[bodies.Result]:
        """Every request's result in order; a failed one fails them all, with the first
        error (the others are cancelled, and so aborted)."""
        tasks = [asyncio.ensure_future(self.run(it, t0)) for it in items]
        try:
            outs = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
        error = next((o for o in outs if isinstance(o, BaseException)), None)
        if error is not None:
            raise error
        return list(outs)

    async def run(
        self,
        item: bodies.GenerateItem,
        t0: float,
        on_delta: Callable[[Output, Delta], None] | None = None,
    ) -> bodies.Result:
        """One request to its end. With `on_delta` it streams: each reply's new tokens (and
        text) go to `on_delta(output, delta)` as they come; the last delta may be text alone
        (what a stop string held back). A request with stop strings streams from the server
        whatever the client asked, and is aborted there once one matched."""
        output = bodies.new_output(item, self.tokenizer)
        first: list[float] = []  # the time to first token, once seen
        aborting: list[asyncio.Future] = []

        def take(ids: Any, reply: dict[str, Any], offset: int = 0) -> None:
            if not isinstance(ids, list):
                return
            delta = output.add(ids, reply, offset)
            if delta is None:
                return
            if not first and delta.ids:
                first.append(time.perf_counter() - t0)
                self.metrics.ttft.observe(first[0])
            if on_delta is not None:
                on_delta(output, delta)
            if output.stopped and not aborting:
                aborting.append(asyncio.ensure_future(self.link.abort(item.rid)))

        def on_partial(reply: dict[str, Any]) -> None:
            take(reply.get("output_ids"), reply)

        streamed = on_delta is not None or bool(item.stops)
        try:
            reply = await self._send(item, on_partial if streamed else None)
            if reply.get("status") == "done" and not output.stopped:
                done_ids = reply.get("output_ids")
                if not isinstance(done_ids, list):  # a server older than output_ids
                    done_ids = [reply["first_token"]]
                take(done_ids[len(output.ids) :], reply, len(output.ids))
            meta = bodies.final_meta(item, output, reply)
        except HttpError:
            self.metrics.failed.inc()
            raise
        rest = output.finish()
        if rest and on_delta is not None:
            on_delta(output, Delta([], rest, final=True))
        latency = time.perf_counter() - t0
        meta["e2e_latency"] = latency
        self.metrics.on_done(meta, latency, bool(first))
        return bodies.Result(item, output, meta)

    async def _send(self, item: bodies.GenerateItem, on_partial) -> dict[str, Any]:
        try:
            return await self.link.generate(
                item.rid,
                item.input_ids,
                item.sampling_params,
                item.bootstrap,
                self.args.request_timeout,
                on_partial,
            )
        except FrameTooLarge as e:
            raise HttpError(413, str(e)) from None
        except NoReply as e:
            raise HttpError(503, str(e)) from None
        except RidInFlight as e:
            raise bad_request(str(e)) from None

    async def _events(
        self, items: list[bodies.GenerateItem], batch: bool, t0: float
    ) -> AsyncIterator[bytes]:
        """Server-sent events, SGLang's: each prompt's output so far as its tokens come
        (with its `index` in a batch), its whole body (or its error) last, then [DONE]. A
        client gone mid-stream cancels this, aborting what is left."""
        events: asyncio.Queue = asyncio.Queue()

        async def run(i: int, item: bodies.GenerateItem) -> None:
            def on_delta(output: Output, delta: Delta) -> None:
                if delta.ids and not delta.final:  # the last event carries the rest
                    meta = bodies.partial_meta(item, output)
                    body = bodies.generate_body(item, output, meta, self.tokenizer)
                    events.put_nowait((i, body))

            try:
                r = await self.run(item, t0, on_delta)
                out = bodies.generate_body(item, r.output, r.meta, self.tokenizer)
            except Exception as e:
                out = error_event(e)
            events.put_nowait((i, out))
            events.put_nowait((i, None))  # this prompt is over

        tasks = [asyncio.ensure_future(run(i, it)) for i, it in enumerate(items)]
        left = len(items)
        try:
            while left:
                i, out = await events.get()
                if out is None:
                    left -= 1
                    continue
                yield sse({**out, "index": i} if batch else out)
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    # ---- the other routes ----------------------------------------------------------------

    async def health(self) -> Response:
        await _answer(self.link.stats(self.args.health_timeout))
        return Response(status_code=200)

    async def health_generate(self) -> Response:
        """A one-token greedy generate of token 0. A prefill or decode server of a PD pair
        cannot generate alone (the other side makes or takes the KV): its stats answer."""
        stats = await self._stats()
        if stats.get("disaggregation_mode") in ("prefill", "decode"):
            return Response(status_code=200)
        rid = f"health-{uuid.uuid4().hex}"
        sampling = {"temperature": 0.0, "max_new_tokens": 1}
        reply = await _answer(
            self.link.generate(rid, [0], sampling, None, self.args.health_timeout)
        )
        if reply.get("status") != "done":
            raise HttpError(503, f"generate failed: {reply.get('error')}")
        return Response(status_code=200)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.tokenizer.path if self.tokenizer else None,
            "is_generation": True,
        }

    async def server_info(self) -> dict[str, Any]:
        """The front's settings, the server's own (role, TP size, KV capacity, as its stats
        say them) and version, and its stats as SGLang's `internal_states`."""
        stats = await self._stats()
        server = {k: stats[k] for k in SERVER_INFO_FIELDS if k in stats}
        settings = {k: v for k, v in dataclasses.asdict(self.args).items() if k != "api_key"}
        info = {**settings, **server, "version": package_version()}
        return {**info, "internal_states": [stats]}

    async def get_load(self) -> list[dict[str, Any]]:
        """SGLang's load, one entry per data-parallel rank (one here), from the scheduler's
        own counters: what sglang-router's load-aware policies poll (they sum
        `num_tokens`)."""
        stats = await self._stats()
        return [{"dp_rank": 0, **stats["load"]}]

    async def _stats(self) -> dict[str, Any]:
        stats = await _answer(self.link.stats(self.args.health_timeout))
        return {k: v for k, v in stats.items() if k not in ("rid", "status")}

    async def abort_request(self, request: Request) -> dict[str, Any]:
        """Abort `rid`, or with `abort_all` every request in flight here; lists the rids
        aborted (none for a rid this front has not in flight: 200 all the same, as SGLang)."""
        body = await read_json(request, self.args.max_body_bytes)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        if body.get("abort_all") is True:
            rids = self.link.rids()
        elif isinstance(body.get("rid"), str):
            rids = [body["rid"]] if self.link.in_flight(body["rid"]) else []
        else:
            raise bad_request("give a string rid, or abort_all: true")
        for rid in rids:
            await self.link.abort(rid)
        return {"rids": rids}

    async def flush_cache(self) -> Response:
        """200 once the scheduler dropped its prefix cache; 400 while requests are live."""
        reply = await self._control("flush_cache")
        return PlainTextResponse(reply["message"] + "\n", 200 if reply["success"] else 400)

    async def metrics_text(self) -> Response:
        """Prometheus text; the scheduler's figures as of a stats reply asked for now."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        try:
            self.metrics.scheduler.update(await self.link.stats(self.args.health_timeout))
        except NoReply as e:
            logger.warning("/metrics without the scheduler's figures: %s", e)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def start_profile(self, request: Request) -> Response:
        """SGLang's body: `output_dir` (default $SGLANG_TORCH_PROFILER_DIR, else the temp
        dir), `num_steps` (stop by itself after that many forwards), `activities`."""
        body = await read_json(request, self.args.max_body_bytes, empty={})
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        default_dir = os.environ.get("SGLANG_TORCH_PROFILER_DIR", tempfile.gettempdir())
        out_dir = body.get("output_dir") or default_dir
        if not isinstance(out_dir, str):
            raise bad_request("output_dir must be a string")
        fields = {"output_dir": os.path.abspath(out_dir), "num_steps": body.get("num_steps")}
        if body.get("activities") is not None:
            fields["activities"] = body["activities"]
        reply = await self._control("start_profile", **fields)
        return _control_response(reply)

    async def stop_profile(self) -> Response:
        return _control_response(await self._control("stop_profile"))

    async def _control(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The scheduler's reply to a control message; its error replies as HttpError."""
        reply = await _answer(self.link.control(kind, self.args.request_timeout, **fields))
        if reply.get("status") == "error":
            raise HttpError(400, str(reply.get("error")))
        return reply


async def _answer(request: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """The scheduler's reply to `request`; 503 where none came in time."""
    try:
        return await request
    except NoReply as e:
        raise HttpError(503, str(e)) from None


def _control_response(reply: dict[str, Any]) -> Response:
    status = 200 if reply.get("success") else 400
    body = {"success": bool(reply.get("success")), "message": reply.get("message")}
    if "files" in reply:
        body["files"] = reply["files"]
    return FastJSONResponse(body, status)


def build_app(
    args: HttpArgs, tokenizer: TextTokenizer | None, template: ChatTemplate | None = None
) -> FastAPI:
    front = HttpFront(args, tokenizer)
    openai = OpenAIServing(front, template, args.served_model_name or args.model_path or "default")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await front.start()
        try:
            yield
        finally:
            await front.close()

    app = FastAPI(title="mpprefill", lifespan=lifespan)
    app.state.front = front
    _add_routes(app, front)
    app.add_api_route("/v1/models", openai.models, methods=["GET"])
    app.add_api_route("/v1/completions", openai.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", openai.chat_completions, methods=["POST"])
    _add_error_handlers(app)
    require_api_key(app, args.api_key)
    return app


def _add_routes(app: FastAPI, front: HttpFront) -> None:
    app.add_api_route("/generate", front.generate, methods=["POST"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/health_generate", front.health_generate, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, front.model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, front.server_info, methods=["GET"])
    app.add_api_route("/get_load", front.get_load, methods=["GET"])
    app.add_api_route("/abort_request", front.abort_request, methods=["POST"])
    app.add_api_route("/metrics", front.metrics_text, methods=["GET"])
    # NOTE: a route per method, so that each has an OpenAPI operation id of its own
    for method in ("GET", "POST"):
        app.add_api_route("/flush_cache", front.flush_cache, methods=[method])
        app.add_api_route("/start_profile", front.start_profile, methods=[method])
        app.add_api_route("/stop_profile", front.stop_profile, methods=[method])


def _add_error_handlers(app: FastAPI) -> None:
    async def http_error(request: Request, e: HttpError) -> Response:
        return FastJSONResponse(e.body(), status_code=e.status)

    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)

    async def internal(request: Request, e: Exception) -> Response:  # logged by the server
        return FastJSONResponse(error_body(500, f"internal error: {type(e).__name__}"), 500)

    app.add_exception_handler(HttpError, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal)
