"""The OpenAI-compatible routes over the front's requests: `/v1/models`,
`/v1/completions` and `/v1/chat/completions`, plain or streamed (server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`).

A body becomes one request per prompt and choice (`n`), each with its own rid and
bootstrap room (sglang-router sends a list of `n` rooms for a chat with `n > 1`, one per
prompt for a completion over a list of prompts); their outputs become the choices. A chat's
prompt is its messages rendered with the model's chat template and encoded without the
tokenizer's own special tokens, as transformers' `apply_chat_template` encodes it.
`max_tokens` unset on a chat is the context left after the prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mpprefill.http import bodies
from mpprefill.http import openai_protocol as op
from mpprefill.http.args import HttpArgs
from mpprefill.http.chat_template import ChatTemplate
from mpprefill.http.errors import bad_request
from mpprefill.http.link import Bootstrap
from mpprefill.http.outputs import Delta, Output
from mpprefill.http.responses import FastJSONResponse, error_event, sse, until_disconnect
from mpprefill.http.tokenizer import TextTokenizer


class Front(Protocol):
    """What these routes use of the front (app.HttpFront)."""

    args: HttpArgs
    tokenizer: TextTokenizer | None

    async def read_body(self, request: Request) -> Any: ...

    async def context_length(self) -> int: ...

    async def run(
        self, item: bodies.GenerateItem, t0: float, on_delta: Any = None
    ) -> bodies.Result: ...

    async def run_all(self, items: list[bodies.GenerateItem], t0: float) -> list: ...


# SGLang's finish reasons as OpenAI names them
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class OpenAIServing:
    def __init__(self, front: Front, template: ChatTemplate | None, model_name: str):
        self.front = front
        self.template = template
        self.model_name = model_name
        self.created = int(time.time())

    # ---- /v1/models ----------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        context = await self.front.context_length()
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mpprefill",
            "root": self.front.args.model_path or self.model_name,
            "max_model_len": context,
        }
        return {"object": "list", "data": [card]}

    # ---- the two generating routes -------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await self.front.read_body(request)
        body = op.parse(op.CompletionRequest, raw)
        context = await self._context_for_text()
        prompts = await asyncio.to_thread(self._completion_prompts, body, context)
        return await self._serve(request, body, prompts, t0, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await self.front.read_body(request)
        body = op.parse(op.ChatCompletionRequest, raw)
        context = await self._context_for_text()
        prompt = await asyncio.to_thread(self._chat_prompt, body, context)
        return await self._serve(request, body, [prompt], t0, chat=True)

    async def _context_for_text(self) -> int | None:
        """The context length that bounds a text prompt's characters (None: no tokenizer,
        so no text)."""
        return await self.front.context_length() if self.front.tokenizer is not None else None

    def _completion_prompts(
        self, body: op.CompletionRequest, context: int | None
    ) -> list[list[int]]:
        """The prompts' ids (on a thread: encoding takes time in proportion to the text)."""
        prompts = body.prompts()
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.front.tokenizer is None:
            raise bad_request("a text prompt needs a tokenizer; this front has none")
        if texts and context is not None:
            bodies.check_text_lengths(texts, self.front.tokenizer, context)
        encoded = iter(self.front.tokenizer.encode(texts) if texts else [])
        out = [next(encoded) if isinstance(p, str) else p for p in prompts]
        if any(not ids for ids in out):
            raise bad_request("a prompt encodes to no tokens")
        if any(type(t) is not int or t < 0 for ids in out for t in ids):
            raise bad_request("prompt token ids must be non-negative integers")
        return out

    def _chat_prompt(self, body: op.ChatCompletionRequest, context: int | None) -> list[int]:
        """The rendered chat's ids (on a thread, as _completion_prompts)."""
        tokenizer = self.front.tokenizer
        if tokenizer is None or self.template is None:
            why = "no tokenizer" if tokenizer is None else "no chat template (give --chat-template)"
            raise bad_request(f"chat needs a tokenizer and a chat template; this front has {why}")
        kwargs = dict(body.chat_template_kwargs or {})
        messages = body.template_messages()
        try:
            text = self.template.render(
                messages, add_generation_prompt=not body.continue_final_message, **kwargs
            )
        except ValueError as e:
            raise bad_request(f"chat template: {e}") from None
        if body.continue_final_message:
            text = _cut_after_final(text, messages[-1].get("content") or "")
        if context is not None:
            bodies.check_text_lengths([text], tokenizer, context)
        (ids,) = tokenizer.encode([text], add_special_tokens=False)
        if not ids:
            raise bad_request("the chat renders to no tokens")
        return ids

    async def _serve(
        self, request: Request, body: op._Common, prompts: list[list[int]], t0: float, chat: bool
    ) -> Response:
        items = await self._items(body, prompts)
        reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            events = self._events(body, items, reply_id, t0, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await until_disconnect(request, self.front.run_all(items, t0))
        choices = [self._choice(body, i, r, chat) for i, r in enumerate(results)]
        reply = {
            "id": reply_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(results, body.n),
        }
        return FastJSONResponse(reply)

    async def _items(self, body: op._Common, prompts: list[list[int]]) -> list[bodies.GenerateItem]:
        """One request per prompt and choice, prompt-major."""
        count = len(prompts) * body.n
        rids = self._rids(body.rid, count)
        rooms, hosts, ports = (
            op.fan_out(getattr(body, f"bootstrap_{k}"), f"bootstrap_{k}", count)
            for k in ("room", "host", "port")
        )
        limit = op.requested_max_tokens(body)
        context = None if limit is not None else await self.front.context_length()
        stops = body.stops()
        items = []
        for j, ids in enumerate(prompts):
            max_new = limit if limit is not None else max(0, context - len(ids))
            for c in range(body.n):
                i = j * body.n + c
                sampling = op.sampling_params(body, max_new, c)
                if stops:
                    sampling["stop"] = stops
                if body.no_stop_trim:
                    sampling["no_stop_trim"] = True
                boot = Bootstrap(rooms[i], hosts[i], ports[i])
                items.append(bodies.make_item(ids, rids[i], sampling, boot))
        if stops and self.front.tokenizer is None:
            raise bad_request("stop strings need a tokenizer; this front has none")
        return items

    @staticmethod
    def _rids(rid: str | list[str] | None, count: int) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if isinstance(rid, list):
            rids = rid
            if len(rids) != count:
                raise bad_request(f"rid has {len(rids)} entries for {count} requests")
        else:
            rids = [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]
        bodies.check_rids(rids)
        return rids

    # ---- replies -------------------------------------------------------------------------

    def _choice(self, body: op._Common, index: int, r: bodies.Result, chat: bool) -> dict[str, Any]:
        finish = r.meta["finish_reason"] or {}
        text = r.output.text if r.output.text is not None else ""
        if isinstance(body, op.CompletionRequest) and body.echo:
            text = self._prompt_text(r.item) + text
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = r.output
        choice["logprobs"] = self._logprobs(body, out.ids, out.logprobs, out.top_logprobs, chat)
        choice["finish_reason"] = _FINISH.get(finish.get("type"), finish.get("type"))
        matched = finish.get("matched")
        if matched is not None:
            choice["matched_stop"] = matched
        return choice

    def _prompt_text(self, item: bodies.GenerateItem) -> str:
        tokenizer = self.front.tokenizer
        if tokenizer is None:
            raise bad_request("echo needs a tokenizer; this front has none")
        return tokenizer.decode(item.input_ids, item.skip_special_tokens)

    def _logprobs(self, body: op._Common, ids: list[int], logprobs, tops, chat: bool):
        """OpenAI's logprobs object for these tokens; None when not asked."""
        k = body.top_logprobs_num
        if k is None:
            return None
        tok = self.front.tokenizer

        def text_of(token: int) -> str:
            return tok.decode([token], False) if tok is not None else str(token)

        tops = tops if tops else [[] for _ in ids]
        if chat:
            content = []
            for token, lp, top in zip(ids, logprobs, tops, strict=False):
                t = text_of(token)
                entry = {"token": t, "logprob": lp, "bytes": list(t.encode())}
                entry["top_logprobs"] = [
                    {"token": (s := text_of(tid)), "logprob": tlp, "bytes": list(s.encode())}
                    for tid, tlp in top[:k]
                ]
                content.append(entry)
            return {"content": content}
        tokens = [text_of(t) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top_dicts = [{text_of(tid): tlp for tid, tlp in top[:k]} for top in tops] if k else None
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    async def _events(
        self,
        body: op._Common,
        items: list[bodies.GenerateItem],
        reply_id: str,
        t0: float,
        chat: bool,
    ) -> AsyncIterator[bytes]:
        """The chunks of every choice as their tokens come, each choice's last with its
        finish reason, the usage chunk when asked, then [DONE]. A failed request is an
        error event; a client gone mid-stream cancels this, aborting what is left."""
        stream = _ChunkStream(reply_id, self.model_name, chat)
        tasks = [
            asyncio.ensure_future(self._stream_choice(stream, body, i, it, t0))
            for i, it in enumerate(items)
        ]
        left, results = len(items), []
        try:
            while left:
                event = await stream.queue.get()
                if isinstance(event, tuple):
                    left -= 1
                    if event[0] == "error":
                        yield sse(error_event(event[1]))
                    else:
                        results.append(event[1])
                    continue
                yield sse(event)
            asked = body.stream_options is not None and body.stream_options.include_usage
            if asked and len(results) == len(items):
                yield sse(stream.usage(_usage(results, body.n)))
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    async def _stream_choice(
        self,
        stream: _ChunkStream,
        body: op._Common,
        index: int,
        item: bodies.GenerateItem,
        t0: float,
    ) -> None:
        """One choice's chunks onto the stream, then ("done", result) or ("error", e)."""

        def on_delta(output: Output, delta: Delta) -> None:
            lps = None
            if delta.logprobs is not None:
                lps = self._logprobs(
                    body, delta.ids, delta.logprobs, delta.top_logprobs, stream.chat
                )
            stream.put(stream.piece(index, delta.text, lps))

        if stream.chat:
            stream.put(stream.role(index))
        elif isinstance(body, op.CompletionRequest) and body.echo:
            stream.put(stream.piece(index, self._prompt_text(item), None))
        try:
            r = await self.front.run(item, t0, on_delta)
        except Exception as e:
            stream.queue.put_nowait(("error", e))
            return
        stream.put(stream.last(index, r.meta["finish_reason"] or {}))
        stream.queue.put_nowait(("done", r))


class _ChunkStream:
    """A streamed reply's chunks in OpenAI's format, queued as the choices make them; the
    queue also carries each choice's end: ("done", result) or ("error", exception)."""

    def __init__(self, reply_id: str, model: str, chat: bool):
        self.chat = chat
        self.queue: asyncio.Queue = asyncio.Queue()
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = {"id": reply_id, "object": kind, "created": int(time.time()), "model": model}

    def put(self, choice: dict[str, Any]) -> None:
        self.queue.put_nowait({**self._head, "choices": [choice]})

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage}

    def piece(self, index: int, text: str, logprobs: Any) -> dict[str, Any]:
        if self.chat:
            return {
                "index": index,
                "delta": {"content": text},
                "logprobs": logprobs,
                "finish_reason": None,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def role(self, index: int) -> dict[str, Any]:
        """A chat choice's first chunk: the assistant's role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def last(self, index: int, finish: dict[str, Any]) -> dict[str, Any]:
        last = self.piece(index, "", None)
        if self.chat:
            last["delta"] = {}
        last["finish_reason"] = _FINISH.get(finish.get("type"), finish.get("type"))
        if finish.get("matched") is not None:
            last["matched_stop"] = finish["matched"]
        return last


def _usage(results: list[bodies.Result], n: int) -> dict[str, int]:
    """A prompt's tokens count once for its n choices; every choice's output counts."""
    prompt = sum(r.meta["prompt_tokens"] for r in results[::n])
    completion = sum(r.meta["completion_tokens"] for r in results)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = sum(r.meta.get("cached_tokens", 0) for r in results[::n])
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _cut_after_final(text: str, final: str) -> str:
    """The rendered chat up to the end of the final message's content, as transformers
    cuts it for `continue_final_message`."""
    final = final.strip()
    at = text.rfind(final)
    if not final or at < 0:
        raise bad_request("continue_final_message: the final message is not in the rendered chat")
    return text[: at + len(final)]
