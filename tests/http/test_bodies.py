"""SGLang's /generate bodies as protocol requests, replies as SGLang's bodies, and the
status of each scheduler error: in this process, no sockets."""

from __future__ import annotations

import pytest

from mpprefill.http import bodies, errors
from mpprefill.http.errors import HttpError

pytestmark = pytest.mark.timeout(60)


def test_single_body_with_sglang_defaults_and_unknown_top_level_keys_ignored():
    body = bodies.parse_generate(
        {
            "input_ids": [1, 2, 3],
            "rid": "a",
            "sampling_params": {"top_k": 5, "stop_token_ids": [2], "ignore_eos": True},
            "bootstrap_room": 11,
            "bootstrap_host": "h",
            "whatever": 1,
        }
    )
    assert (body.batch, body.stream) == (False, False)
    (item,) = body.items
    assert (item.rid, item.input_ids, item.text, item.bootstrap.room) == ("a", [1, 2, 3], None, 11)
    assert (item.bootstrap.host, item.bootstrap.port) == ("h", None)
    assert item.sampling_params == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "min_p": 0.0,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "max_new_tokens": 128,  # SGLang's default, for a decode server behind the same front
    }
    assert item.max_new_tokens == 128 and item.skip_special_tokens


def test_batch_fans_out_lists_and_single_values():
    body = bodies.parse_generate(
        {
            "text": ["x", "y"],
            "sampling_params": [{"temperature": 0}, {"max_new_tokens": 0, "sampling_seed": 3}],
            "bootstrap_room": 5,
            "bootstrap_host": ["h1", "h2"],
            "bootstrap_port": 8998,
            "stream": True,
        }
    )
    assert body.batch and body.stream
    a, b = body.items
    assert (a.text, b.text) == ("x", "y") and a.rid != b.rid
    assert (a.bootstrap.room, b.bootstrap.room) == (5, 5)
    assert (a.bootstrap.host, b.bootstrap.host) == ("h1", "h2")
    assert (a.bootstrap.port, b.bootstrap.port) == (8998, 8998)
    assert a.sampling_params["temperature"] == 0
    assert (b.max_new_tokens, b.sampling_params["max_new_tokens"]) == (0, 1)
    assert b.sampling_params["seed"] == 3


@pytest.mark.parametrize(
    "body",
    [
        None,
        {"input_ids": [[1], 2]},
        {"text": []},
        {"text": ["a", 1]},
        {"input_ids": [1], "rid": ""},
        {"input_ids": [1], "rid": "r" * 300},
        {"input_ids": [1], "bootstrap_room": True},
        {"input_ids": [1], "bootstrap_room": 2**63},
        {"input_ids": [1], "bootstrap_host": 7},
        {"input_ids": [1], "bootstrap_port": 70000},
        {"input_ids": [[1], [2]], "bootstrap_host": ["a"]},
        {"input_ids": [1], "stream": "yes"},
        {"input_ids": [1], "sampling_params": {"seed": -1}},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}},
        {"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]},
    ],
)
def test_bad_bodies_are_400(body):
    with pytest.raises(HttpError) as e:
        bodies.parse_generate(body)
    assert e.value.status == 400 and e.value.body()["error"]["code"] == 400


def test_text_without_a_tokenizer_is_400():
    items = bodies.parse_generate({"text": "hello"}).items
    with pytest.raises(HttpError) as e:
        bodies.tokenize(items, None)
    assert e.value.status == 400 and "tokenizer" in e.value.message


def _final_body(item, reply, latency, tokenizer) -> dict:
    """The body the front answers a request with whose one reply is `reply`."""
    output = bodies.new_output(item, tokenizer)
    if reply.get("status") == "done":
        output.add(reply.get("output_ids") or [reply["first_token"]], reply)
    meta = {**bodies.final_meta(item, output, reply), "e2e_latency": latency}
    return bodies.generate_body(item, output, meta, tokenizer)


def _item(max_new: int = 128) -> bodies.GenerateItem:
    sampling = {"max_new_tokens": max_new}
    return bodies.parse_generate(
        {"input_ids": [4, 5], "rid": "q", "sampling_params": sampling}
    ).items[0]


def test_done_reply_is_sglangs_body():
    reply = {"rid": "q", "status": "done", "first_token": 9, "prompt_tokens": 2, "cached_tokens": 1}
    out = _final_body(_item(), reply, 0.25, None)
    assert out == {
        "output_ids": [9],
        "meta_info": {
            "id": "q",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 2,
            "completion_tokens": 1,
            "cached_tokens": 1,
            "e2e_latency": 0.25,
        },
    }
    assert _final_body(_item(0), reply, 0.1, None)["output_ids"] == []


def test_aborted_reply_is_an_abort_finish_and_other_errors_raise():
    aborted = {"rid": "q", "status": "error", "error": errors.ABORTED}
    out = _final_body(_item(), aborted, 0.1, None)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    with pytest.raises(HttpError) as e:
        _final_body(_item(), {"rid": "q", "status": "error", "error": "overloaded"}, 0, None)
    assert e.value.status == 429


def test_a_decode_servers_output_is_the_done_replys_and_cut_to_max_new_tokens():
    """Nothing assumes one output token: ids, finish reason and count are the reply's."""
    reply = {
        "rid": "q",
        "status": "done",
        "first_token": 9,
        "prompt_tokens": 2,
        "cached_tokens": 0,
        "output_ids": [9, 8, 7, 2],
        "completion_tokens": 4,
        "finish_reason": {"type": "stop", "matched": 2},
    }
    out = _final_body(_item(), reply, 0.5, None)
    assert out["output_ids"] == [9, 8, 7, 2]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert out["meta_info"]["completion_tokens"] == 4
    cut = _final_body(_item(2), reply, 0.5, None)
    assert cut["output_ids"] == [9, 8]
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert cut["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("code", "reason", "status"),
    [
        (400, "anything at all", 400),
        (413, "frame too big", 413),
        (429, "overloaded", 429),
        (503, "server shutting down", 503),
        (500, "empty input_ids", 500),  # the code wins over the reason's words
        (404, "unknown rid", 400),
        (418, "a 4xx the front does not name", 400),
        (599, "a 5xx the front does not name", 500),
    ],
)
def test_an_error_replys_code_is_its_status(code, reason, status):
    reply = {"rid": "q", "status": "error", "error": reason, "code": code}
    with pytest.raises(HttpError) as e:
        _final_body(_item(), reply, 0, None)
    assert (e.value.status, e.value.message) == (status, reason)


def test_code_499_is_an_abort_whatever_the_reason():
    reply = {"rid": "q", "status": "error", "error": "KV transfer failed: aborted", "code": 499}
    out = _final_body(_item(), reply, 0.1, None)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("overloaded", 429),
        ("server shutting down", 503),
        ("frame of 5000000 bytes exceeds the limit of 4194304 bytes", 413),
        ("empty input_ids", 400),
        ("token id 99999 outside the vocabulary [0, 4096)", 400),
        ("prompt of 90 tokens exceeds the context length 64", 400),
        ("prompt of 9000 tokens exceeds the KV pool (4096 tokens)", 400),
        ("sampling_params: sampling_params.top_p must be in (0, 1], got 0", 400),
        ("duplicate rid while the first is live", 400),
        ("worker failure: the forward process exited", 500),
        ("transfer failure: thread died", 500),
        ("bootstrap timed out", 500),
        ("internal server error", 500),
    ],
)
def test_scheduler_errors_map_to_statuses(reason, status):
    assert errors.status_of(reason) == status


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ({"regex": "a+"}, "regex"),
        ({"json_schema": "{}"}, "json_schema"),
        ({"ebnf": "root ::= 'a'"}, "ebnf"),
        ({"n": 2}, "n"),
        ({"min_new_tokens": 3}, "min_new_tokens"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
    ],
)
def test_a_sampling_key_not_done_is_400_naming_it(sampling, named):
    with pytest.raises(HttpError) as e:
        bodies.parse_generate({"input_ids": [1], "sampling_params": sampling})
    assert e.value.status == 400 and named in e.value.message


def test_neutral_values_of_unimplemented_keys_and_front_keys_are_taken():
    sampling = {"n": 1, "regex": None, "min_new_tokens": 0, "stop": ["x"], "no_stop_trim": True}
    (item,) = bodies.parse_generate({"input_ids": [1], "sampling_params": sampling}).items
    assert (item.stops, item.no_stop_trim) == (("x",), True)
    assert "stop" not in item.sampling_params and "n" not in item.sampling_params


def test_input_logprobs_are_400_and_output_logprobs_travel():
    with pytest.raises(HttpError) as e:
        bodies.parse_generate({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0})
    assert e.value.status == 400 and "logprob_start_len" in e.value.message
    body = bodies.parse_generate(
        {"input_ids": [[1], [2]], "return_logprob": [True, False], "top_logprobs_num": 2}
    )
    a, b = body.items
    assert (a.sampling_params["return_logprob"], a.sampling_params["top_logprobs_num"]) == (
        True,
        2,
    )
    assert "return_logprob" not in b.sampling_params


def test_logprobs_in_sglangs_shape():
    body = bodies.parse_generate(
        {"input_ids": [4, 5], "return_logprob": True, "top_logprobs_num": 2, "rid": "q"}
    )
    (item,) = body.items
    reply = {
        "status": "done",
        "first_token": 9,
        "output_ids": [9, 8],
        "prompt_tokens": 2,
        "cached_tokens": 0,
        "output_token_logprobs": [-0.5, -1.5],
        "output_top_logprobs": [[[9, -0.5], [3, -2.0]], [[8, -1.5], [9, -1.6]]],
    }
    meta = _final_body(item, reply, 0.1, None)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 9, None], [-1.5, 8, None]]
    assert meta["output_top_logprobs"] == [
        [[-0.5, 9, None], [-2.0, 3, None]],
        [[-1.5, 8, None], [-1.6, 9, None]],
    ]
