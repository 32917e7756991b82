"""The HTTP front as its own process before a real `mpprefill serve` (fake transfer):
SGLang's bodies in and out, text through a tokenizer, streams, and bad bodies."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

from mpprefill import PrefillEngine  # noqa: E402
from mpprefill.model import ModelConfig  # noqa: E402
from tests.http.conftest import BODY_LIMIT, CONTEXT_LENGTH, VOCAB  # noqa: E402
from tests.http.helpers import sse_events  # noqa: E402

pytestmark = pytest.mark.timeout(240)
GREEDY = {"temperature": 0.0}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13] * 4, [100] * 20]


@pytest.fixture(scope="module")
def expected_first():
    with PrefillEngine(forward_mode="normal") as eng:
        return {tuple(p): o.first_token for p, o in zip(PROMPTS, eng.prefill(PROMPTS))}


def test_the_tiny_vocab_is_the_tokenizers():
    assert ModelConfig.tiny().vocab_size == VOCAB


def test_single_input_ids(ids_front, expected_first):
    body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    status, out = ids_front.post("/generate", {**body, "rid": "single-1"})
    assert status == 200, out
    assert "text" not in out  # no tokenizer: ids only
    assert out["output_ids"] == [expected_first[tuple(PROMPTS[0])]]
    meta = out["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"] == {"type": "length", "length": 1}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 1)
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0


def test_batch_input_ids_in_order(ids_front, expected_first):
    body = {
        "input_ids": PROMPTS,
        "rid": ["b0", "b1", "b2"],
        "sampling_params": [GREEDY, {**GREEDY, "top_k": 1}, GREEDY],
        "bootstrap_room": [7, 8, 9],
    }
    status, out = ids_front.post("/generate", body)
    assert status == 200, out
    assert [o["meta_info"]["id"] for o in out] == ["b0", "b1", "b2"]
    assert [o["output_ids"] for o in out] == [[expected_first[tuple(p)]] for p in PROMPTS]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(p) for p in PROMPTS]


def test_unknown_top_level_fields_ignored_and_rid_generated(ids_front, expected_first):
    sampling = {
        **GREEDY,
        "max_new_tokens": 16,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "frequency_penalty": 0.5,
    }
    body = {
        "input_ids": PROMPTS[1],
        "sampling_params": sampling,
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "return_logprob": False,
        "lora_path": None,
        "no_such_field": [1, 2],
    }
    status, out = ids_front.post("/generate", body)
    assert status == 200, out
    assert out["output_ids"] == [expected_first[tuple(PROMPTS[1])]]
    rid = out["meta_info"]["id"]
    assert len(rid) == 32 and int(rid, 16) >= 0  # a uuid's hex


def test_max_new_tokens_zero_gives_no_output_token(ids_front):
    body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 0}}
    status, out = ids_front.post("/generate", body)
    assert status == 200, out
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0


def test_a_repeated_prompt_is_served_from_the_cache(ids_front):
    prompt = list(range(200, 240))
    replies = [ids_front.post("/generate", {"input_ids": prompt})[1] for _ in range(2)]
    assert replies[0]["meta_info"]["prompt_tokens"] == 40
    assert replies[1]["meta_info"]["cached_tokens"] > 0, replies


def test_many_requests_in_flight_at_once(ids_front, expected_first):
    def one(i: int):
        body = {"input_ids": PROMPTS[i % 3], "rid": f"many-{i}", "sampling_params": GREEDY}
        return ids_front.post("/generate", body)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    for i, (status, out) in enumerate(results):
        assert status == 200, out
        assert out["meta_info"]["id"] == f"many-{i}"
        assert out["output_ids"] == [expected_first[tuple(PROMPTS[i % 3])]]


def test_stream_is_server_sent_events(ids_front, expected_first):
    body = json.dumps({"input_ids": PROMPTS[2], "stream": True, "sampling_params": GREEDY})
    status, headers, data = ids_front.request("POST", "/generate", body.encode())
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    assert events[-1] == "[DONE]" and len(events) == 2, events
    assert events[0]["output_ids"] == [expected_first[tuple(PROMPTS[2])]]
    assert events[0]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_stream_indexes_each_prompt_and_carries_errors(ids_front):
    prompts = [PROMPTS[0], [1, VOCAB + 5]]
    body = json.dumps({"input_ids": prompts, "stream": True})
    status, _, data = ids_front.request("POST", "/generate", body.encode())
    assert status == 200
    events = sse_events(data)
    assert events[-1] == "[DONE]" and len(events) == 3, events
    by_index = {e["index"]: e for e in events[:-1]}
    assert by_index[0]["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    assert by_index[1]["error"]["code"] == 400
    assert "vocabulary" in by_index[1]["error"]["message"]


BAD_BODIES = [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2, 3]", 400, "object"),
    (b"{}", 400, "exactly one"),
    (b'{"text": "a", "input_ids": [1]}', 400, "exactly one"),
    (b'{"input_ids": []}', 400, "non-empty"),
    (b'{"input_ids": [[1, 2], []]}', 400, "non-empty"),
    (b'{"input_ids": "1 2 3"}', 400, "input_ids"),
    (b'{"input_ids": [1, true]}', 400, "non-negative integers"),
    (b'{"input_ids": [1, -3]}', 400, "non-negative integers"),
    (b'{"input_ids": [1], "rid": 7}', 400, "rid"),
    (b'{"input_ids": [[1], [2]], "rid": "one"}', 400, "rid"),
    (b'{"input_ids": [[1], [2]], "rid": ["x", "x"]}', 400, "differ"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', 400, "top_p"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', 400, "temperature"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens"),
    (b'{"input_ids": [1], "sampling_params": [1]}', 400, "sampling_params"),
    (b'{"input_ids": [1], "bootstrap_room": -1}', 400, "bootstrap_room"),
    (b'{"input_ids": [[1], [2]], "bootstrap_room": [1]}', 400, "bootstrap_room"),
    (b'{"text": "hello"}', 400, "tokenizer"),
    (b'{"input_ids": [1, 5000]}', 400, "vocabulary"),  # refused by the scheduler
    (b'{"input_ids": [[1, 2], [1, 5000]]}', 400, "vocabulary"),  # one prompt of a batch
    (json.dumps({"input_ids": [1] * (CONTEXT_LENGTH + 1)}).encode(), 400, "context length"),
]


@pytest.mark.parametrize(("body", "status", "why"), BAD_BODIES)
def test_bad_bodies_get_their_status(ids_front, body, status, why):
    got, _, data = ids_front.request("POST", "/generate", body)
    out = json.loads(data)
    assert got == status, (body, out)
    assert out["error"]["code"] == status and why in out["error"]["message"], (body, out)


def test_bodies_over_the_limit_get_413_unread_and_the_front_keeps_serving(ids_front):
    # A Content-Length over the limit is refused before any of the body is read ...
    headers = {"Content-Length": str(BODY_LIMIT * 16), "Content-Type": "application/json"}
    conn_status = _refused_by_length(ids_front, headers)
    assert conn_status == 413
    # ... and a chunked body (no length) as soon as it passes the limit.
    chunks = [b'{"input_ids": ['] + [b"1, " * 4096] * 8 + [b"1]}"]
    assert sum(map(len, chunks)) > BODY_LIMIT
    status, _, data = ids_front.request("POST", "/generate", iter(chunks))
    assert status == 413 and json.loads(data)["error"]["code"] == 413
    status, out = ids_front.post("/generate", {"input_ids": PROMPTS[0]})
    assert status == 200, out


def _refused_by_length(front, headers: dict[str, str]) -> int:
    """POST headers claiming a large body, then only its first bytes."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    try:
        conn.putrequest("POST", "/generate")
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(b'{"input_ids": [1, 2')
        return conn.getresponse().status
    finally:
        conn.close()


def test_health_model_and_server_info(ids_front):
    assert ids_front.request("GET", "/health")[0] == 200
    assert ids_front.request("GET", "/health_generate")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = ids_front.get(path)
        assert status == 200
        assert info == {"model_path": None, "tokenizer_path": None, "is_generation": True}
    for path in ("/server_info", "/get_server_info"):
        status, info = ids_front.get(path)
        assert status == 200
        assert info["port"] == ids_front.port and info["skip_tokenizer_init"] is False
        assert info["internal_states"][0]["forward_mode"] == "normal"


def test_abort_and_flush(ids_front):
    assert ids_front.post("/abort_request", {"rid": "never-sent"}) == (200, {"rids": []})
    assert ids_front.post("/abort_request", {"abort_all": True})[0] == 200
    status, out = ids_front.post("/abort_request", {"rid": 5})
    assert status == 400 and out["error"]["code"] == 400


def test_flush_cache_drops_the_prefix_cache(ids_front):
    prompt = list(range(300, 340))
    replies = [ids_front.post("/generate", {"input_ids": prompt})[1] for _ in range(2)]
    assert replies[1]["meta_info"]["cached_tokens"] > 0, replies
    status, _, text = ids_front.request("POST", "/flush_cache")
    assert status == 200 and text.startswith(b"cache flushed"), text
    status, out = ids_front.post("/generate", {"input_ids": prompt})
    assert status == 200 and out["meta_info"]["cached_tokens"] == 0, out
    status, info = ids_front.get("/server_info")
    assert info["internal_states"][0]["kv"]["cached_tokens"] == len(prompt) // 16 * 16


def test_text_in_and_out_through_the_tokenizer(text_front, tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = ["w5 w6 w7 w8", "w300 w301"]
    ids = [[1] + tok.encode(t, add_special_tokens=False).ids for t in texts]  # BOS first
    assert ids[0] == [1, 5, 6, 7, 8]
    with PrefillEngine(forward_mode="normal") as eng:
        firsts = [o.first_token for o in eng.prefill(ids)]
    status, out = text_front.post("/generate", {"text": texts, "sampling_params": GREEDY})
    assert status == 200, out
    for o, first, prompt in zip(out, firsts, ids):
        assert o["output_ids"] == [first]
        assert o["text"] == tok.decode([first]) and (first < 3 or o["text"] == f"w{first}")
        assert o["meta_info"]["prompt_tokens"] == len(prompt)
    status, out = text_front.post("/generate", {"input_ids": ids[1], "sampling_params": GREEDY})
    assert status == 200 and out["output_ids"] == [firsts[1]] and "text" in out


def test_text_front_model_info_and_batch_rids(text_front, tokenizer_dir):
    status, info = text_front.get("/model_info")
    assert status == 200 and info["tokenizer_path"] == str(tokenizer_dir)
    status, out = text_front.post("/generate", {"text": ["w5", "w6"], "rid": ["t1"]})
    assert status == 400 and "rid" in out["error"]["message"]
