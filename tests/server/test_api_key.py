"""`--api-key`: every HTTP route but /health needs `Authorization: Bearer KEY`, on the
front a server spawns (given the key in its environment, never its command line) and on a
front started alone; the request socket stays on loopback whatever `--host` is."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpprefill.bench.procs import free_port, front_pids, terminate
from mpprefill.cli import build_parser
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.flags import from_namespace
from mpprefill.http.auth import API_KEY_ENV, ApiKeyMiddleware
from mpprefill.launch_server import translate
from mpprefill.server.client import Client
from tests.server.test_binds import non_loopback_address, reachable

pytest.importorskip("fastapi", reason="the HTTP front needs the http extra")
pytestmark = pytest.mark.timeout(120)
KEY = "k3y-" + "x" * 28
UNAUTHORIZED = {
    "error": {"message": "a valid API key is required: Authorization: Bearer KEY", "code": 401}
}
GUARDED = [  # (method, path, body): a route of each kind, the scheduler's and the front's own
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/health_generate", None),
    ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}),
    ("POST", "/flush_cache", None),
    ("GET", "/no_such_route", None),
]


# ---- the middleware alone -------------------------------------------------------------------


def _call(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes, bool]:
    """(status, body, whether the app behind was reached) of one HTTP request."""
    reached = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "GET", "headers": headers}
    asyncio.run(ApiKeyMiddleware(app, KEY)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body, bool(reached)


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"Bearer " + KEY[:-1].encode())],  # a prefix of the key
        [(b"authorization", b"Bearer " + KEY.encode() + b"x")],
        [(b"authorization", b"Basic " + KEY.encode())],
        [(b"authorization", KEY.encode())],
        [(b"x-api-key", KEY.encode())],
    ],
)
def test_the_middleware_refuses_a_missing_or_wrong_key_before_the_route(headers):
    status, body, reached = _call("/generate", headers)
    assert (status, json.loads(body), reached) == (401, UNAUTHORIZED, False)


@pytest.mark.parametrize("scheme", [b"Bearer ", b"bearer ", b"BEARER "])
def test_the_middleware_passes_the_right_key_in_any_case_of_the_scheme(scheme):
    assert _call("/generate", [(b"authorization", scheme + KEY.encode())]) == (200, b"ok", True)


def test_health_needs_no_key_and_lifespan_passes():
    assert _call("/health", []) == (200, b"ok", True)
    assert _call("/health/", [])[0] == 401  # only the exact path is open
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(ApiKeyMiddleware(app, KEY)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


# ---- the flags ------------------------------------------------------------------------------


def test_api_key_and_zmq_host_parse_through_launch_server_and_stay_out_of_repr():
    argv = ["--disaggregation-mode", "prefill", "--api-key", KEY, "--zmq-host", "0.0.0.0"]
    args = from_namespace(ServerArgs, build_parser().parse_args(translate(argv)))
    assert (args.api_key, args.zmq_host, args.host) == (KEY, "0.0.0.0", "127.0.0.1")
    assert KEY not in repr(args)
    argv = ["--disaggregation-mode", "decode", "--api-key", KEY]
    decode = from_namespace(DecodeArgs, build_parser().parse_args(translate(argv)))
    assert (decode.api_key, decode.zmq_host) == (KEY, "127.0.0.1")
    assert KEY not in repr(decode)
    for cls in (ServerArgs, DecodeArgs):
        with pytest.raises(ValueError, match="--api-key must not be empty"):
            cls(api_key="")


# ---- a served front -------------------------------------------------------------------------


class Serve:
    """`mpprefill serve --host 0.0.0.0 --api-key KEY` with the fake transfer."""

    def __init__(self):
        self.port, self.zmq_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "mpprefill", "serve", "--host", "0.0.0.0"]
        cmd += ["--port", str(self.port), "--zmq-port", str(self.zmq_port), "--api-key", KEY]
        cmd += ["--disaggregation-transfer-backend", "fake", "--forward-mode", "normal"]
        cmd += ["--max-total-tokens", "1024", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = Client(f"127.0.0.1:{self.zmq_port}")
        try:
            client.stats(timeout=90)
        finally:
            client.close()


def request(
    port: int, method: str, path: str, body=None, key: str | None = None
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    for _ in range(100):  # the front may still be starting
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except ConnectionRefusedError:
            time.sleep(0.2)
        finally:
            conn.close()
    raise TimeoutError(f"nothing answers on {port}")


@pytest.fixture(scope="module")
def serve():
    s = Serve()
    yield s
    terminate(s.proc)


def test_a_served_front_opens_health_alone(serve):
    assert request(serve.port, "GET", "/health") == (200, b"")
    for method, path, body in GUARDED:
        for key in (None, "wrong", KEY.upper()):
            status, data = request(serve.port, method, path, body, key)
            assert (status, json.loads(data)) == (401, UNAUTHORIZED), (path, key)


def test_a_served_front_answers_the_right_key(serve):
    statuses = {path: request(serve.port, m, path, b, KEY)[0] for m, path, b in GUARDED}
    assert statuses == {path: 404 if path == "/no_such_route" else 200 for _, path, _ in GUARDED}
    status, data = request(serve.port, "POST", "/generate", GUARDED[5][2], KEY)
    assert len(json.loads(data)["output_ids"]) == 1


def test_server_info_does_not_give_the_key_back(serve):
    status, data = request(serve.port, "GET", "/server_info", None, KEY)
    assert status == 200 and KEY.encode() not in data
    assert "api_key" not in json.loads(data)


def test_the_key_reaches_the_front_in_its_environment_not_its_command_line(serve):
    (pid,) = front_pids(serve.proc.pid)
    assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"{API_KEY_ENV}={KEY}".encode() in environ


def test_the_request_socket_stays_on_loopback_under_a_wildcard_host(serve):
    address = non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    assert request(serve.port, "GET", "/health")[0] == 200  # the front: every interface
    assert reachable(address, serve.port)
    assert reachable("127.0.0.1", serve.zmq_port)
    assert not reachable(address, serve.zmq_port)


# ---- a front alone --------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_front_alone_takes_the_key_from_its_flag_or_the_environment(serve, how, monkeypatch):
    from tests.http.helpers import Front

    flags = ["--api-key", "other"] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv(API_KEY_ENV, "other")
    front = Front.start(serve.zmq_port, *flags, timeout=60)
    try:
        assert request(front.port, "GET", "/model_info")[0] == 401
        assert request(front.port, "GET", "/model_info", key=KEY)[0] == 401
        assert request(front.port, "GET", "/model_info", key="other")[0] == 200
    finally:
        front.kill()
