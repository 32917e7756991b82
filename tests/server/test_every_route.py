"""Every route of the HTTP front answers on a prefill and on a decode server (the built-in
model, on --port alone), to a valid request and to an invalid one, without a 5xx: a
decode server has no prefix cache to flush (success) and does not profile (400). The
table of requests covers every route the app registers, so a new route needs its row."""

from __future__ import annotations

import json
import tempfile
import threading
import warnings

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mpprefill.bench.procs import free_base_port  # noqa: E402
from mpprefill.http.app import build_app  # noqa: E402
from mpprefill.http.args import HttpArgs  # noqa: E402
from mpprefill.ports import BOOTSTRAP_OFFSET, RECEIVER_OFFSET, ZMQ_OFFSET  # noqa: E402
from tests.server.test_ports import HOST, MAX_TOTAL_TOKENS, Server  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ONE = {"temperature": 0.0, "max_new_tokens": 2}
PROFILE_DIR = tempfile.mkdtemp(prefix="mpp-profile-")
# (method, path, valid body, invalid body); None: no body. A GET route's invalid request is
# the wrong method.
ROUTES = [
    ("GET", "/health", None, None),
    ("GET", "/health_generate", None, None),
    ("GET", "/model_info", None, None),
    ("GET", "/get_model_info", None, None),
    ("GET", "/server_info", None, None),
    ("GET", "/get_server_info", None, None),
    ("GET", "/get_load", None, None),
    ("GET", "/metrics", None, None),
    ("GET", "/v1/models", None, None),
    ("GET", "/flush_cache", None, None),
    ("POST", "/flush_cache", b"", None),
    ("POST", "/abort_request", {"rid": "no-such-rid"}, [1]),
    ("POST", "/start_profile", {"output_dir": PROFILE_DIR}, {"output_dir": 5}),
    ("POST", "/stop_profile", b"", None),
    ("GET", "/start_profile", None, None),
    ("GET", "/stop_profile", None, None),
    ("POST", "/generate", "pair", {"text": 5}),
    ("POST", "/v1/completions", "pair", {"prompt": []}),
    ("POST", "/v1/chat/completions", "pair", {"messages": "hi"}),
    ("GET", "/openapi.json", None, None),
    ("GET", "/docs", None, None),
    ("GET", "/docs/oauth2-redirect", None, None),
    ("GET", "/redoc", None, None),
]
# a valid request's status where it is not 200
DECODE_STATUS = {"/start_profile": 400, "/stop_profile": 400}
PAIR_BODIES = {
    "/generate": {"input_ids": list(range(10, 30)), "sampling_params": ONE},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    },
}


def test_the_table_covers_every_route_the_app_registers():
    app = build_app(HttpArgs(), None)
    registered = {(m, r.path) for r in app.routes for m in getattr(r, "methods", ()) or ()}
    registered -= {("HEAD", r.path) for r in app.routes}
    assert registered == {(m, p) for m, p, _, _ in ROUTES}


def test_every_operation_has_an_openapi_id_of_its_own():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate id
        schema = build_app(HttpArgs(), None).openapi()
    ops = {
        (m.upper(), path): op for path, item in schema["paths"].items() for m, op in item.items()
    }
    ids = [op["operationId"] for op in ops.values()]
    assert len(ids) == len(set(ids)) == len(ops)
    docs = {"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"}  # FastAPI's own pages
    assert set(ops) == {(m, p) for m, p, _, _ in ROUTES if p not in docs}


@pytest.fixture(scope="module")
def pair():
    """(prefill, decode): `mpprefill serve` and `mpprefill decode` on --port alone."""
    offsets = [i + o for i in range(2) for o in (0, ZMQ_OFFSET, RECEIVER_OFFSET, BOOTSTRAP_OFFSET)]
    base = free_base_port(offsets)
    with pytest.MonkeyPatch.context() as mp:  # where a profile without output_dir goes
        mp.setenv("SGLANG_TORCH_PROFILER_DIR", PROFILE_DIR)
        servers = [Server("serve", base), Server("decode", base + 1)]
    try:
        for s in servers:
            s.wait_healthy(180)
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.kill()


def _send(server: Server, method: str, path: str, body) -> tuple[int, bytes]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    status, _, out = server.request(method, path, data, headers, timeout=120)
    return status, out


def _through_pair(prefill: Server, decode: Server, path: str, room: int) -> dict:
    """The same request to both sides at once, as a PD router sends it: the decode's reply
    (the output), once the prefill's is 200 too."""
    boot = {"bootstrap_room": room, "bootstrap_host": HOST}
    boot["bootstrap_port"] = prefill.port + BOOTSTRAP_OFFSET
    body = {**PAIR_BODIES[path], **boot}
    replies = {}

    def run(name: str, server: Server) -> None:
        replies[name] = _send(server, "POST", path, body)

    threads = [threading.Thread(target=run, args=x) for x in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert replies["p"][0] == 200, replies["p"]
    assert replies["d"][0] == 200, replies["d"]
    return json.loads(replies["d"][1])


def test_every_route_answers_on_both_servers(pair):
    prefill, decode = pair
    answers = {}
    for room, (method, path, valid, invalid) in enumerate(ROUTES, start=100):
        if valid == "pair":
            out = _through_pair(prefill, decode, path, room)
            answers[(path, "pair")] = out
            for server in pair:
                assert _send(server, method, path, invalid)[0] == 400, (server.port, path)
            continue
        for server, kind in ((prefill, "prefill"), (decode, "decode")):
            status, out = _send(server, method, path, valid)
            want = DECODE_STATUS.get(path, 200) if kind == "decode" else 200
            assert status == want, (kind, method, path, status, out[:300])
            answers[(kind, method, path)] = out
            bad_method = "PUT" if invalid is None else method
            status, out = _send(server, bad_method, path, invalid)
            assert 400 <= status < 500, (kind, bad_method, path, status, out[:300])
    generated = answers[("/generate", "pair")]
    assert len(generated["output_ids"]) == 2, generated
    chat = answers[("/v1/chat/completions", "pair")]
    assert chat["usage"]["completion_tokens"] == 2, chat


def test_the_decodes_metrics_are_its_own(pair):
    """The decode's /metrics: its batch, queues and KV pool, from its own stats."""
    _, decode = pair
    status, _, data = decode.request("GET", "/metrics")
    assert status == 200, data
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(data.decode())
        for s in family.samples
    }
    assert samples["sglang:max_total_num_tokens"] == MAX_TOTAL_TOKENS
    status, load = decode.get("/get_load")
    assert samples["sglang:num_used_tokens"] == load[0]["num_tokens"]
    for name in ("num_running_reqs", "num_queue_reqs", "num_decode_transfer_queue_reqs"):
        assert samples[f"sglang:{name}"] == 0, name
