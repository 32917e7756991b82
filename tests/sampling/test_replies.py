"""Logprobs in the request protocol's replies: present where the request asked, aligned
with the reply's output_ids; replies of before otherwise."""

from __future__ import annotations

import json

from mpprefill import protocol
from mpprefill.sampling.token_logprob import UNKNOWN, TokenLogprob

LPS = [TokenLogprob(-0.5, [[7, -0.5], [9, -1.25]]), TokenLogprob(-2.0, [[3, -0.1], [8, -2.0]])]


def test_done_reply_carries_each_output_tokens_logprob():
    reply = json.loads(protocol.done_reply("a", 7, 5, 0, [7, 8], None, LPS, top_logprobs=True))
    assert reply["output_ids"] == [7, 8]
    assert reply["output_token_logprobs"] == [-0.5, -2.0]
    assert reply["output_top_logprobs"] == [[[7, -0.5], [9, -1.25]], [[3, -0.1], [8, -2.0]]]
    no_top = json.loads(protocol.done_reply("a", 7, 5, 0, [7, 8], None, LPS))
    assert no_top["output_token_logprobs"] == [-0.5, -2.0] and "output_top_logprobs" not in no_top


def test_replies_of_requests_that_did_not_ask_keep_their_shape():
    done = json.loads(protocol.done_reply("a", 7, 5, 2))
    assert set(done) == {
        "rid",
        "status",
        "first_token",
        "prompt_tokens",
        "cached_tokens",
        "output_ids",
        "completion_tokens",
        "finish_reason",
    }
    partial = json.loads(protocol.partial_reply("a", [1, 2]))
    assert partial == {"rid": "a", "status": "partial", "output_ids": [1, 2]}


def test_partial_reply_carries_its_new_tokens_logprobs():
    reply = json.loads(protocol.partial_reply("a", [8], LPS[1:], top_logprobs=True))
    assert reply["output_token_logprobs"] == [-2.0]
    assert reply["output_top_logprobs"] == [[[3, -0.1], [8, -2.0]]]
    unknown = json.loads(protocol.partial_reply("a", [8], [UNKNOWN], top_logprobs=True))
    assert unknown["output_token_logprobs"] == [None] and unknown["output_top_logprobs"] == [[]]
