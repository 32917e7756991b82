"""SGLang's `/generate` request bodies, as the requests the scheduler's protocol carries,
and the scheduler's replies as SGLang's response bodies.

A body is one request or a batch: `text` a list of strings, or `input_ids` a list of
lists. In a batch, `rid` is a list (one per prompt), and `sampling_params`, the
`bootstrap_*` fields and the logprob fields are lists or one value for every prompt.
Unknown top-level fields are ignored, as SGLang does; a `sampling_params` key is either
done (by the servers: the protocol's keys; by this front: `stop`, `no_stop_trim`,
`skip_special_tokens`, `max_new_tokens`) or refused with a 400 naming it: an unknown key,
or one this server does not implement (`regex`, `json_schema`, `ebnf`, `n` above 1, ...).

The output is the server's: the done reply's `output_ids` (a prefill server's one token,
a decode server's every token), cut to `max_new_tokens` (0: none) or at a stop string, its
`finish_reason` and `completion_tokens`, and with `return_logprob` each output token's
logprob (`[logprob, token_id, text or null]`, SGLang's shape). A streamed prompt's partial
replies add tokens to its output; each server-sent event carries the output so far, as
SGLang's do.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from mpprefill.http.errors import bad_request, from_reply, is_abort
from mpprefill.http.link import Bootstrap
from mpprefill.http.outputs import Output
from mpprefill.http.tokenizer import TextTokenizer
from mpprefill.protocol import ABORTED, MAX_RID_CHARS, bootstrap_error
from mpprefill.sampling.params import MAX_TOP_LOGPROBS, SamplingParams

# SGLang's defaults where the protocol's differ (it samples at temperature 1 unless told).
SGLANG_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
SGLANG_MAX_NEW_TOKENS = 128
_WIRE_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# sampling_params keys this front does itself
_FRONT_KEYS = frozenset(
    ("max_new_tokens", "skip_special_tokens", "stop", "no_stop_trim", "sampling_seed")
)
# SGLang's keys no server here implements, with the value that asks for nothing: any other
# value is refused.
_NEUTRAL_KEYS = {
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "min_new_tokens": 0,
    "n": 1,
    "logit_bias": None,
    "custom_params": None,
    "spaces_between_special_tokens": True,
    "stream_interval": None,
}


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
    stops: tuple[str, ...] = ()
    no_stop_trim: bool = False
    text_in_logprobs: bool = False  # /generate's return_text_in_logprobs


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
    logprobs = _logprob_fields(body, n, batch)
    items = [
        _item(p, rid, sp, Bootstrap(*b), lp)
        for p, rid, sp, b, lp in zip(prompts, rids, params, boots, logprobs)
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
    check_rids(rids)
    return rids


def check_rids(rids: list[Any]) -> None:
    for r in rids:
        if not isinstance(r, str) or not 0 < len(r) <= MAX_RID_CHARS:
            raise bad_request(f"a rid must be a string of 1 to {MAX_RID_CHARS} characters")
    if len(set(rids)) != len(rids):
        raise bad_request("the rids of a batch must differ")


def _per_prompt(body: dict, name: str, n: int, batch: bool) -> list[Any]:
    """The field's value for each prompt: a batch's list, or one value for all."""
    value = body.get(name)
    if not batch or not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise bad_request(f"{name} has {len(value)} entries for a batch of {n}")
    return value


def _logprob_fields(body: dict, n: int, batch: bool) -> list[tuple[bool, int, bool]]:
    """(return_logprob, top_logprobs_num, return_text_in_logprobs) per prompt. Input
    logprobs (`logprob_start_len` other than -1) are not implemented: 400."""
    start = body.get("logprob_start_len")
    if start is not None and start != -1:
        raise bad_request("logprob_start_len: input logprobs are not supported (only -1)")
    fields = []
    for want, k, text in zip(
        _per_prompt(body, "return_logprob", n, batch),
        _per_prompt(body, "top_logprobs_num", n, batch),
        _per_prompt(body, "return_text_in_logprobs", n, batch),
    ):
        if want is not None and not isinstance(want, bool):
            raise bad_request("return_logprob must be a boolean")
        if k is not None and (type(k) is not int or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise bad_request(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if text is not None and not isinstance(text, bool):
            raise bad_request("return_text_in_logprobs must be a boolean")
        fields.append((bool(want), k or 0, bool(text)))
    return fields


def _item(
    prompt: str | list[int],
    rid: str,
    sampling: Any,
    boot: Bootstrap,
    logprobs: tuple[bool, int, bool] = (False, 0, False),
) -> GenerateItem:
    if sampling is not None and not isinstance(sampling, dict):
        raise bad_request("sampling_params must be an object")
    sampling = dict(sampling or {})
    want, k, text_in_logprobs = logprobs
    if want:
        sampling.update(return_logprob=True, top_logprobs_num=k)
    return make_item(prompt, rid, sampling, boot, text_in_logprobs)


def make_item(
    prompt: str | list[int],
    rid: str,
    sampling: dict[str, Any],
    boot: Bootstrap,
    text_in_logprobs: bool = False,
) -> GenerateItem:
    """One request from its SGLang `sampling_params`, every key checked."""
    why = bootstrap_error(boot.room, boot.host, boot.port)
    if why is not None:
        raise bad_request(why)
    _refuse_unsupported(sampling)
    max_new = sampling.get("max_new_tokens", SGLANG_MAX_NEW_TOKENS)
    if type(max_new) is not int or max_new < 0:
        raise bad_request("sampling_params.max_new_tokens must be a non-negative integer")
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    skip = sampling.get("skip_special_tokens", True)
    no_trim = sampling.get("no_stop_trim", False)
    if not isinstance(skip, bool) or not isinstance(no_trim, bool):
        raise bad_request("sampling_params.skip_special_tokens and no_stop_trim are booleans")
    wire = _wire_sampling(sampling, max_new)
    stops = _stops(sampling.get("stop"))
    return GenerateItem(rid, text, ids, wire, max_new, skip, boot, stops, no_trim, text_in_logprobs)


def _refuse_unsupported(sampling: dict[str, Any]) -> None:
    for key, value in sampling.items():
        if key in _WIRE_KEYS or key in _FRONT_KEYS:
            continue
        if key not in _NEUTRAL_KEYS:
            raise bad_request(f"sampling_params.{key}: unknown field")
        if value is not None and value != _NEUTRAL_KEYS[key]:
            raise bad_request(f"sampling_params.{key} is not supported by this server")


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("sampling_params.stop must be a non-empty string or a list of them")
    return tuple(stops)


def _wire_sampling(sampling: dict, max_new: int) -> dict[str, Any]:
    """The keys the protocol carries, over SGLang's defaults, checked as the scheduler
    checks them. NOTE: max_new_tokens 0 travels as 1: a server always samples one; the
    reply is cut to none."""
    given = {k: v for k, v in sampling.items() if k in _WIRE_KEYS and v is not None}
    if "seed" not in given and sampling.get("sampling_seed") is not None:
        given["seed"] = sampling["sampling_seed"]
    given["max_new_tokens"] = max(1, max_new)
    wire = {**SGLANG_SAMPLING_DEFAULTS, **given}
    try:
        SamplingParams.from_dict(wire)
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from None
    return wire


def tokenize(
    items: list[GenerateItem], tokenizer: TextTokenizer | None, context_length: int | None = None
) -> list[GenerateItem]:
    """Every item with its input_ids; text needs a tokenizer, and so do stop strings. With
    `context_length`, a text longer than any prompt that fits is refused unencoded."""
    if tokenizer is None and any(it.stops for it in items):
        raise bad_request("stop strings need a tokenizer; this front has none")
    texts = [it.text for it in items if it.text is not None]
    if not texts:
        return items
    if tokenizer is None:
        raise bad_request("text input needs a tokenizer; this front has none: send input_ids")
    if context_length is not None:
        check_text_lengths(texts, tokenizer, context_length)
    encoded = iter(tokenizer.encode(texts))
    out = [
        it if it.text is None else dataclasses.replace(it, input_ids=next(encoded)) for it in items
    ]
    if any(not it.input_ids for it in out):
        raise bad_request("a text encodes to no tokens")
    return out


def max_text_chars(tokenizer: TextTokenizer, context_length: int) -> int:
    """The most characters a text of `context_length` tokens can have: each token covers at
    most `max_token_chars`, plus one for a separator a pre-tokenizer drops between tokens
    (whitespace splitting). NOTE: exact for byte-level BPE and SentencePiece, which keep
    every character; a text padded with runs of whitespace that a whitespace-splitting
    tokenizer would drop is refused too."""
    return context_length * (tokenizer.max_token_chars + 1)


def check_text_lengths(texts: list[str], tokenizer: TextTokenizer, context_length: int) -> None:
    """400 for a text too long in characters to fit `context_length` tokens, before any of
    it is encoded: encoding costs time and memory in proportion to the text."""
    limit = max_text_chars(tokenizer, context_length)
    for text in texts:
        if len(text) > limit:
            raise bad_request(
                f"a text of {len(text)} characters is longer than any prompt of the context"
                f" length ({context_length} tokens, at most {limit} characters) can be"
            )


@dataclass(frozen=True, slots=True)
class Result:
    """A request that ended: its output and SGLang's meta_info for it."""

    item: GenerateItem
    output: Output
    meta: dict[str, Any]


def new_output(item: GenerateItem, tokenizer: TextTokenizer | None) -> Output:
    return Output(
        tokenizer, item.max_new_tokens, item.stops, item.no_stop_trim, item.skip_special_tokens
    )


def final_meta(item: GenerateItem, output: Output, reply: dict[str, Any]) -> dict[str, Any]:
    """meta_info's counts and finish reason from the server's final reply, the output
    (HttpError for an error; a request /abort_request ended is an "abort" finish). A
    request this front aborted at a stop string ends well, whatever the server replied."""
    status = reply.get("status")
    prompt = len(item.input_ids or ())
    if status == "done":
        finish = output.finish_reason(reply.get("finish_reason"))
        prompt, cached = reply["prompt_tokens"], reply["cached_tokens"]
    elif output.stopped and status == "error" and is_abort(reply):
        finish, cached = output.finish_reason(None), 0
    elif status == "error" and is_abort(reply):
        return {
            "id": item.rid,
            "finish_reason": {"type": "abort", "message": ABORTED},
            "prompt_tokens": prompt,
            "completion_tokens": 0,
            "cached_tokens": 0,
        }
    else:
        raise from_reply(reply)
    return {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": len(output.ids),
        "cached_tokens": cached,
    }


def generate_body(
    item: GenerateItem, output: Output, meta: dict[str, Any], tokenizer: TextTokenizer | None
) -> dict[str, Any]:
    """SGLang's body for one prompt, final (meta from final_meta) or partial (a streamed
    prompt's event before its last: no finish reason). `text` is there only with a
    tokenizer."""
    aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
    ids = [] if aborted else list(output.ids)
    meta = dict(meta)
    if item.sampling_params.get("return_logprob") and not aborted:
        meta.update(_sglang_logprobs(item, output, tokenizer))
    body: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if tokenizer is not None:
        body = {"text": "" if aborted else output.text, **body}
    return body


def partial_meta(item: GenerateItem, output: Output) -> dict[str, Any]:
    return {
        "id": item.rid,
        "finish_reason": None,
        "prompt_tokens": len(item.input_ids or ()),
        "completion_tokens": len(output.ids),
    }


def _sglang_logprobs(item: GenerateItem, output: Output, tokenizer) -> dict[str, Any]:
    """`output_token_logprobs` as [logprob, id, text] and `output_top_logprobs` as a list of
    them per token; the text only with return_text_in_logprobs and a tokenizer."""

    def entry(logprob: float, token: int) -> list:
        text = None
        if item.text_in_logprobs and tokenizer is not None:
            text = tokenizer.decode([token], False)
        return [logprob, token, text]

    meta: dict[str, Any] = {
        "output_token_logprobs": [
            entry(lp, t) for lp, t in zip(output.logprobs, output.ids, strict=False)
        ]
    }
    if item.sampling_params.get("top_logprobs_num"):
        meta["output_top_logprobs"] = [
            [entry(lp, t) for t, lp in top] for top in output.top_logprobs
        ]
    return meta
