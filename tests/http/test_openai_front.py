"""The OpenAI routes of a front over a prefill server running the built-in model, with the
built-in byte-level tokenizer and its chat template: the prompt the front builds, the one
token a prefill samples as OpenAI's bodies and chunks, and the 400s. (Whole completions
through a decode side: tests/e2e/test_router.py.)"""

from __future__ import annotations

import json

import pytest

from mpprefill.http.chat_template import ChatTemplate
from mpprefill.http.tokenizer import TextTokenizer
from tests.http.conftest import CONTEXT_LENGTH, VOCAB
from tests.http.helpers import Front, sse_events

pytest.importorskip("fastapi", reason="the HTTP front needs the http extra")
pytestmark = pytest.mark.timeout(120)
GREEDY = {"temperature": 0}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


@pytest.fixture(scope="module")
def front(serve):
    f = Front.start(serve.port, "--vocab-size", str(VOCAB), "--served-model-name", "tiny")
    yield f
    f.kill()


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.builtin(VOCAB)


def first_token(front: Front, ids: list[int]) -> int:
    status, out = front.post("/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert status == 200, out
    return out["output_ids"][0]


def test_models_lists_the_served_name_and_context(front):
    status, out = front.get("/v1/models")
    assert status == 200, out
    (card,) = out["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == ("tiny", "model", CONTEXT_LENGTH)


def test_chat_prompt_is_the_template_rendered_and_the_reply_openais(front, tokenizer):
    text = ChatTemplate.load(None, None, True).render(CHAT, add_generation_prompt=True)
    (ids,) = tokenizer.encode([text], add_special_tokens=False)
    token = first_token(front, ids)
    status, out = front.post(
        "/v1/chat/completions", {"model": "x", "messages": CHAT, "max_tokens": 1, **GREEDY}
    )
    assert status == 200, out
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode([token])}
    assert choice["finish_reason"] == "length"
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 1)
    assert usage["total_tokens"] == len(ids) + 1
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt went first


def test_completion_of_text_and_of_ids(front, tokenizer):
    (ids,) = tokenizer.encode(["abc"])
    token = first_token(front, ids)
    for prompt in ("abc", ids):
        status, out = front.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, **GREEDY})
        assert status == 200, out
        assert out["object"] == "text_completion"
        assert out["choices"][0]["text"] == tokenizer.decode([token])
    status, out = front.post(
        "/v1/completions", {"prompt": "abc", "max_tokens": 1, "echo": True, **GREEDY}
    )
    assert out["choices"][0]["text"] == "abc" + tokenizer.decode([token])


def test_streamed_chat_is_openais_chunks(front, tokenizer):
    body = {
        "messages": CHAT,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
    }
    status, headers, data = front.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == tokenizer.decode([chunks_token(front, tokenizer)])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 1


def chunks_token(front: Front, tokenizer: TextTokenizer) -> int:
    text = ChatTemplate.load(None, None, True).render(CHAT, add_generation_prompt=True)
    return first_token(front, tokenizer.encode([text], add_special_tokens=False)[0])


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "regex": "a+"}, "regex"),
        ("/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, "frobnicate"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "bootstrap_room": 5}, "rooms"),
        ("/v1/completions", {"prompt": "x", "logprobs": 9}, "logprobs"),
        ("/v1/completions", {"prompt": [VOCAB + 1], "max_tokens": 1}, "vocabulary"),
        ("/v1/completions", {"prompt": "x" * (CONTEXT_LENGTH + 5)}, "context"),
    ],
)
def test_bad_bodies_are_400_naming_the_field(front, path, body, named):
    status, out = front.post(path, body)
    assert status == 400, out
    assert named in out["error"]["message"], out


def test_chat_without_a_tokenizer_is_400(ids_front):
    status, out = ids_front.post("/v1/chat/completions", {"messages": CHAT})
    assert status == 400 and "tokenizer" in out["error"]["message"]
