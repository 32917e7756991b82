"""The OpenAI bodies: what each field becomes, and a 400 naming each field that asks for
what no server here does: in this process, no sockets."""

from __future__ import annotations

import pytest

from mpprefill.http import openai_protocol as op
from mpprefill.http.errors import HttpError

pytestmark = pytest.mark.timeout(60)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_sampling_fields_map_to_sglangs_and_seeds_differ_per_choice():
    body = op.parse(
        op.ChatCompletionRequest,
        {
            **CHAT,
            "temperature": 0.5,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "seed": 10,
            "n": 3,
            "logprobs": True,
            "top_logprobs": 4,
            "stop_token_ids": [7],
            "ignore_eos": True,
        },
    )
    params = [op.sampling_params(body, 12, c) for c in range(3)]
    assert params[0] == {
        "max_new_tokens": 12,
        "temperature": 0.5,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "seed": 10,
        "stop_token_ids": [7],
        "ignore_eos": True,
        "return_logprob": True,
        "top_logprobs_num": 4,
        "skip_special_tokens": True,
    }
    assert [p["seed"] for p in params] == [10, 11, 12]


def test_max_tokens_defaults():
    chat = op.parse(op.ChatCompletionRequest, CHAT)
    assert op.requested_max_tokens(chat) is None  # the context left
    both = op.parse(op.ChatCompletionRequest, {**CHAT, "max_tokens": 9, "max_completion_tokens": 5})
    assert op.requested_max_tokens(both) == 5
    completion = op.parse(op.CompletionRequest, {"prompt": "x"})
    assert op.requested_max_tokens(completion) == op.COMPLETION_MAX_TOKENS


def test_completion_prompts_of_every_shape():
    def prompts(p):
        return op.parse(op.CompletionRequest, {"prompt": p}).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_router_fields_at_their_defaults_are_taken():
    """What sglang-router writes into every chat body it forwards."""
    body = {
        **CHAT,
        "stream": False,
        "no_stop_trim": False,
        "ignore_eos": False,
        "continue_final_message": False,
        "skip_special_tokens": True,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "bootstrap_host": ["h", "h"],
        "bootstrap_port": [1, 1],
        "bootstrap_room": [5, 6],
        "n": 2,
    }
    parsed = op.parse(op.ChatCompletionRequest, body)
    assert op.fan_out(parsed.bootstrap_room, "bootstrap_room", 2) == [5, 6]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"regex": "a"}, "regex"),
        ({"json_schema": {"type": "object"}}, "json_schema"),
        ({"ebnf": "x"}, "ebnf"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ],
)
def test_what_is_not_done_is_400_naming_it(extra, named):
    with pytest.raises(HttpError) as e:
        body = op.parse(op.ChatCompletionRequest, {**CHAT, **extra})
        body.stops()
    assert e.value.status == 400 and named in e.value.message


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 6}, "logprobs"),
    ],
)
def test_completion_refusals(extra, named):
    with pytest.raises(HttpError) as e:
        op.parse(op.CompletionRequest, {"prompt": "x", **extra})
    assert e.value.status == 400 and named in e.value.message


def test_one_room_for_several_requests_is_refused():
    with pytest.raises(HttpError):
        op.fan_out(5, "bootstrap_room", 2)
    with pytest.raises(HttpError):
        op.fan_out([5], "bootstrap_room", 2)
    assert op.fan_out("h", "bootstrap_host", 2) == ["h", "h"]


def test_content_parts_join_as_the_template_reads_them():
    body = op.parse(
        op.ChatCompletionRequest,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        },
    )
    assert body.template_messages() == [{"role": "user", "content": "ab"}]
