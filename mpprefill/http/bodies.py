"""SGLang's `/generate` request bodies, as the requests the scheduler's protocol carries,
and the scheduler's replies as SGLang's response bodies.

A body is one request or a batch: `text` a list of strings, or `input_ids` a list of
lists. In a batch, `rid` is a list (one per prompt), and `sampling_params` and the
`bootstrap_*` fields are lists or one value for every prompt. Unknown fields, and unknown
`sampling_params` keys, are ignored, as SGLang does; those the scheduler's protocol does not
carry (`skip_special_tokens`, `return_logprob`, ...) as well.

The output is the server's: the done reply's `output_ids` (a prefill server's one token,
a decode server's every token), cut to `max_new_tokens` (0: none), its `finish_reason` and
`completion_tokens`. A streamed prompt's partial replies add tokens to its output; each
server-sent event carries the output so far, as SGLang's do.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from mpprefill.http.errors import bad_request, from_reply, is_abort
from mpprefill.http.link import Bootstrap
from mpprefill.http.tokenizer import TextTokenizer
from mpprefill.sampling.params import SamplingParams
from mpprefill.server.protocol import ABORTED, MAX_RID_CHARS, bootstrap_error

# SGLang's defaults where the protocol's differ (it samples at temperature 1 unless told).
SGLANG_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
SGLANG_MAX_NEW_TOKENS = 128
_WIRE_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True, slots=True)
class GenerateItem:
    """One prompt of a body: `text` until tokenized, then `input_ids`."""

    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]  # the protocol's keys only, validated
    max_new_tokens: int  # SGLang's: 0 is allowed (no output token)
    skip_special_tokens: bool
    bootstrap: Bootstrap


@dataclass(frozen=True, slots=True)
class GenerateBody:
    items: list[GenerateItem]
    batch: bool
    stream: bool


def parse_generate(body: Any) -> GenerateBody:
    """The body's prompts; HttpError(400) for anything the front will not send."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    prompts, batch = _prompts(body)
    n = len(prompts)
    rids = _rids(body.get("rid"), n, batch)
    params = _per_prompt(body, "sampling_params", n, batch)
    boots = zip(*(_per_prompt(body, f"bootstrap_{k}", n, batch) for k in ("room", "host", "port")))
    items = [
        _item(p, rid, sp, Bootstrap(*b)) for p, rid, sp, b in zip(prompts, rids, params, boots)
    ]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean")
    return GenerateBody(items, batch, stream)


def _prompts(body: dict) -> tuple[list[str | list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of text and input_ids")
    if text is not None:
        return _texts(text)
    if not isinstance(ids, list) or not ids:
        raise bad_request("input_ids must be a non-empty list of token ids, or a list of them")
    if not isinstance(ids[0], list):
        return [_token_ids(ids)], False
    return [_token_ids(one) for one in ids], True


def _texts(text: Any) -> tuple[list[str], bool]:
    if isinstance(text, str):
        return [text], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return list(text), True
    raise bad_request("text must be a string or a non-empty list of strings")


def _token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise bad_request("each input_ids must be a non-empty list of token ids")
    if not all(type(t) is int and t >= 0 for t in ids):
        raise bad_request("input_ids must hold non-negative integers only")
    return ids


def _rids(rid: Any, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    rids = rid if batch else [rid]
    if batch and (not isinstance(rid, list) or len(rid) != n):
        raise bad_request(f"rid must be a list of {n} strings for a batch of {n}")
    for r in rids:
        if not isinstance(r, str) or not 0 < len(r) <= MAX_RID_CHARS:
            raise bad_request(f"a rid must be a string of 1 to {MAX_RID_CHARS} characters")
    if len(set(rids)) != n:
        raise bad_request("the rids of a batch must differ")
    return rids


def _per_prompt(body: dict, name: str, n: int, batch: bool) -> list[Any]:
    """The field's value for each prompt: a batch's list, or one value for all."""
    value = body.get(name)
    if not batch or not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise bad_request(f"{name} has {len(value)} entries for a batch of {n}")
    return value


def _item(prompt: str | list[int], rid: str, sampling: Any, boot: Bootstrap) -> GenerateItem:
    why = bootstrap_error(boot.room, boot.host, boot.port)
    if why is not None:
        raise bad_request(why)
    if sampling is not None and not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object")
    sampling = sampling or {}
    max_new = sampling.get("max_new_tokens", SGLANG_MAX_NEW_TOKENS)
    if type(max_new) is not int or max_new < 0:
        raise bad_request("sampling_params.max_new_tokens must be a non-negative integer")
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    skip = sampling.get("skip_special_tokens", True)
    wire = _wire_sampling(sampling, max_new)
    return GenerateItem(rid, text, ids, wire, max_new, skip is not False, boot)


def _wire_sampling(sampling: dict, max_new: int) -> dict[str, Any]:
    """The keys the protocol carries, over SGLang's defaults, checked as the scheduler
    checks them. NOTE: max_new_tokens 0 travels as 1: a server always samples one; the
    reply is cut to none."""
    given = {k: sampling[k] for k in _WIRE_KEYS if sampling.get(k) is not None}
    if "seed" not in given and sampling.get("sampling_seed") is not None:
        given["seed"] = sampling["sampling_seed"]
    given["max_new_tokens"] = max(1, max_new)
    wire = {**SGLANG_SAMPLING_DEFAULTS, **given}
    try:
        SamplingParams.from_dict(wire)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from None
    return wire


def tokenize(items: list[GenerateItem], tokenizer: TextTokenizer | None) -> list[GenerateItem]:
    """Every item with its input_ids; text needs a tokenizer."""
    texts = [it.text for it in items if it.text is not None]
    if not texts:
        return items
    if tokenizer is None:
        raise bad_request("text input needs a tokenizer; this front has none: send input_ids")
    encoded = iter(tokenizer.encode(texts))
    out = [
        it if it.text is None else dataclasses.replace(it, input_ids=next(encoded)) for it in items
    ]
    if any(not it.input_ids for it in out):
        raise bad_request("a text encodes to no tokens")
    return out


def generate_reply(
    item: GenerateItem, reply: dict[str, Any], latency: float, tokenizer: TextTokenizer | None
) -> dict[str, Any]:
    """SGLang's body for one prompt from the server's final reply (HttpError for an error;
    a request /abort_request ended is a body with an "abort" finish reason). `text` is
    there only with a tokenizer."""
    if reply.get("status") == "done":
        out_ids, finish, completion = _output(item, reply)
        prompt, cached = reply["prompt_tokens"], reply["cached_tokens"]
    elif reply.get("status") == "error" and is_abort(reply):
        out_ids, finish, completion = [], {"type": "abort", "message": ABORTED}, 0
        prompt, cached = len(item.input_ids or ()), 0
    else:
        raise from_reply(reply)
    meta = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "e2e_latency": latency,
    }
    return _body(item, out_ids, meta, tokenizer)


def _output(item: GenerateItem, reply: dict[str, Any]) -> tuple[list[int], dict, int]:
    """(output_ids, finish_reason, completion_tokens) of a done reply, cut to max_new_tokens."""
    out_ids = reply.get("output_ids")
    if not isinstance(out_ids, list):  # a server older than output_ids
        out_ids = [reply["first_token"]]
    if len(out_ids) > item.max_new_tokens:
        out_ids = out_ids[: item.max_new_tokens]
        return out_ids, {"type": "length", "length": len(out_ids)}, len(out_ids)
    finish = reply.get("finish_reason") or {"type": "length", "length": len(out_ids)}
    return out_ids, finish, reply.get("completion_tokens", len(out_ids))


def partial_body(
    item: GenerateItem, output_ids: list[int], tokenizer: TextTokenizer | None
) -> dict[str, Any]:
    """A streamed prompt's event before its last: the output so far, no finish reason."""
    meta = {
        "id": item.rid,
        "finish_reason": None,
        "prompt_tokens": len(item.input_ids or ()),
        "completion_tokens": len(output_ids),
    }
    return _body(item, output_ids, meta, tokenizer)


def _body(item: GenerateItem, out_ids: list[int], meta: dict, tokenizer) -> dict[str, Any]:
    body: dict[str, Any] = {"output_ids": out_ids, "meta_info": meta}
    if tokenizer is not None:
        body = {"text": tokenizer.decode(out_ids, item.skip_special_tokens), **body}
    return body
