"""Servers on one host told apart by --port alone: two prefills and three decodes whose
other ports all derive from it, KV moving between them, all five behind SGLang's router;
SGLang's /get_load and /server_info on both kinds; a port in use is one line and exit
status 2; a request a prefill cannot send KV for (no bootstrap_room) is a 400 naming the
field."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mpprefill import protocol  # noqa: E402
from mpprefill.bench.procs import free_base_port  # noqa: E402
from mpprefill.ports import BOOTSTRAP_OFFSET, RECEIVER_OFFSET, ZMQ_OFFSET  # noqa: E402
from mpprefill.server.client import Client  # noqa: E402
from tests.http.helpers import Front  # noqa: E402

pytestmark = pytest.mark.timeout(300)
HOST = "127.0.0.1"
MAX_TOTAL_TOKENS = 4096
SERVE_FLAGS = ("--disaggregation-transfer-backend", "shm", "--forward-mode", "normal")
DECODE_FLAGS = ()
COMMON_FLAGS = ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--log-level", "warning")
# the prefills' --port is B and B + 1, the decodes' B + 2 to B + 4, the router's B + 5:
# every port derived from those must be free too
OFFSETS = [i + o for i in range(5) for o in (0, ZMQ_OFFSET, RECEIVER_OFFSET, BOOTSTRAP_OFFSET)]
OFFSETS.append(5)
IDLE = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


class Server(Front):
    """`mpprefill serve|decode --port P` and its HTTP front, no other port given."""

    def __init__(self, command: str, port: int):
        self.port = port
        self.log = tempfile.NamedTemporaryFile(prefix=f"mpp-{command}-", suffix=".log")  # noqa: SIM115
        flags = SERVE_FLAGS if command == "serve" else DECODE_FLAGS
        cmd = [sys.executable, "-m", "mpprefill", command, "--port", str(port), *flags]
        self.proc = subprocess.Popen(
            [*cmd, *COMMON_FLAGS], stdout=self.log, stderr=subprocess.STDOUT
        )

    def client(self) -> Client:
        """A client of its ZeroMQ request socket, on the port derived from --port."""
        return Client(f"{HOST}:{self.port + ZMQ_OFFSET}")

    def load(self) -> dict:
        status, load = self.get("/get_load")
        assert status == 200 and isinstance(load, list) and len(load) == 1, load
        return load[0]

    def load_until(self, ok: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while not ok(load := self.load()):
            assert time.monotonic() < deadline, load
            time.sleep(0.05)
        return load


class Router(Front):
    """sglang-router in PD mode over the prefills (each with its derived bootstrap port)
    and the decodes."""

    def __init__(self, port: int, prefills: list[Server], decodes: list[Server]):
        self.port = port
        self.log = tempfile.NamedTemporaryFile(prefix="mpp-router-", suffix=".log")  # noqa: SIM115
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for p in prefills:
            cmd += ["--prefill", f"http://{HOST}:{p.port}", str(p.port + BOOTSTRAP_OFFSET)]
        for d in decodes:
            cmd += ["--decode", f"http://{HOST}:{d.port}"]
        cmd += ["--host", HOST, "--port", str(port), "--policy", "round_robin"]
        cmd += ["--prometheus-port", str(free_base_port([0]))]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def cluster():
    """(prefills, decodes), all healthy, started together on --port alone."""
    base = free_base_port(OFFSETS)
    servers = [Server("serve", base), Server("serve", base + 1)]
    servers += [Server("decode", base + i) for i in (2, 3, 4)]
    try:
        for s in servers:
            s.wait_healthy(180)
        yield servers[:2], servers[2:], base
    finally:
        stop_together(servers)


def stop_together(servers: list[Server]) -> None:
    """SIGTERM to every server first, so that the five shut down side by side; then each
    is waited for, and stopped as `Front.kill` does if it has not exited by then."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(10)
        s.kill()


def _listening(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=5).close()
    except OSError:
        return False
    return True


def test_two_prefills_and_three_decodes_run_given_port_alone(cluster):
    prefills, decodes, _ = cluster
    for s in (*prefills, *decodes):
        status, info = s.get("/server_info")
        assert status == 200 and info["zmq_address"] == f"{HOST}:{s.port + ZMQ_OFFSET}"
    for s in prefills:
        assert _listening(s.port + BOOTSTRAP_OFFSET), "no bootstrap endpoint"
    for s in decodes:
        assert _listening(s.port + RECEIVER_OFFSET), "no receiver"


def test_kv_moves_to_each_decode_from_the_prefill_it_names(cluster):
    """Decode i registers its room at prefill i's derived bootstrap port and generates on
    the KV that comes. While a decode waits for its KV, its /get_load counts the request and
    the pages it holds; while a prefill waits for its decode, it counts the request."""
    prefills, decodes, _ = cluster
    ids = list(range(10, 40))
    for i, decode_first in ((0, True), (1, False)):
        prefill, decode = prefills[i].client(), decodes[i].client()
        bootstrap = prefills[i].port + BOOTSTRAP_OFFSET
        params = {"temperature": 0.0, "max_new_tokens": 4}
        to_decode = protocol.generate_frame(f"r{i}", ids, params, 70 + i, HOST, bootstrap)
        try:
            if decode_first:
                decode.send_raw(to_decode)
                load = decodes[i].load_until(lambda x: x["num_reqs"] == 1)
                assert load["num_waiting_reqs"] == 1 and load["num_tokens"] >= len(ids)
                prefill.generate(f"r{i}", ids, 70 + i)
            else:
                prefill.generate(f"r{i}", ids, 70 + i)
                load = prefills[i].load_until(lambda x: x["num_reqs"] == 1)
                assert load == {**IDLE, "num_reqs": 1, "num_waiting_reqs": 1}
                decode.send_raw(to_decode)
            assert prefill.recv(60)["status"] == "done"
            reply = decode.recv(60)
            assert reply["status"] == "done" and len(reply["output_ids"]) == 4, reply
        finally:
            prefill.close()
            decode.close()
    for s in (*prefills, *decodes):
        assert s.load_until(lambda x: x == IDLE) == IDLE


def test_all_five_serve_behind_the_router(cluster):
    """sglang-router in PD mode over the two prefills (each with its derived bootstrap port)
    and the three decodes: round robin sends requests through every pair, and every pair
    gives the built-in model's same greedy output, by /generate and by the OpenAI route."""
    pytest.importorskip("sglang_router", reason="needs the sglang-router package")
    prefills, decodes, base = cluster
    router = Router(base + 5, prefills, decodes)
    try:
        body = {"input_ids": list(range(10, 30)), "sampling_params": GREEDY_4}
        outs = [_through(router, "/generate", body)["output_ids"] for _ in range(6)]
        assert len(outs[0]) == 4 and outs == [outs[0]] * 6, outs
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        replies = [
            _through(router, "/v1/chat/completions", {**chat, "temperature": 0}) for _ in range(3)
        ]
        assert len({r["choices"][0]["message"]["content"] for r in replies}) == 1
        assert all(r["usage"]["completion_tokens"] == 4 for r in replies)
    finally:
        router.kill()
    for s in (*prefills, *decodes):
        assert s.load_until(lambda x: x == IDLE) == IDLE


GREEDY_4 = {"temperature": 0.0, "max_new_tokens": 4}


def _through(router: Front, path: str, body: dict, timeout: float = 120.0) -> dict:
    """The router's 200 reply; it may answer 503 until it has probed its workers."""
    deadline = time.monotonic() + timeout
    while True:
        assert router.proc.poll() is None, "the router exited"
        try:
            headers = {"Content-Type": "application/json"}
            status, _, data = router.request("POST", path, json.dumps(body).encode(), headers)
        except OSError:
            status, data = None, b""
        out = json.loads(data) if status == 200 else data
        if status == 200:
            return out
        assert time.monotonic() < deadline, (status, out)
        time.sleep(0.5)


def test_server_info_says_role_size_capacity_and_version(cluster):
    prefills, decodes, _ = cluster
    for servers, mode in ((prefills, "prefill"), (decodes, "decode")):
        for s in servers:
            for path in ("/server_info", "/get_server_info"):
                status, info = s.get(path)
                assert status == 200
                assert info["disaggregation_mode"] == mode and info["tp_size"] == 1
                assert info["max_total_num_tokens"] == MAX_TOTAL_TOKENS
                assert info["version"] == metadata.version("mpprefill")
            load = s.load()
            assert sorted(load) == sorted(IDLE) and all(type(v) is int for v in load.values())


def test_a_request_without_bootstrap_room_is_400_naming_it(cluster):
    prefill = cluster[0][0]
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 4}}
    status, out = prefill.post("/generate", body)
    assert status == 400 and "missing bootstrap_room" in out["error"]["message"], out
    client = prefill.client()
    try:
        client.generate("no-room", [1, 2, 3])
        reply = client.recv(30)
    finally:
        client.close()
    assert reply["status"] == "error" and reply["code"] == 400, reply
    assert reply["error"].startswith("missing bootstrap_room"), reply


@pytest.mark.parametrize(
    ("command", "offset", "flag"),
    [
        ("serve", 0, "--port"),
        ("serve", ZMQ_OFFSET, "--zmq-port"),
        ("serve", BOOTSTRAP_OFFSET, "--disaggregation-bootstrap-port"),
        ("decode", 0, "--port"),
        ("decode", ZMQ_OFFSET, "--zmq-port"),
        ("decode", RECEIVER_OFFSET, "--receiver-port"),
    ],
)
def test_a_port_in_use_is_one_line_and_exit_status_2(command, offset, flag):
    base = free_base_port((ZMQ_OFFSET, RECEIVER_OFFSET, BOOTSTRAP_OFFSET))
    flags = SERVE_FLAGS if command == "serve" else DECODE_FLAGS
    cmd = [sys.executable, "-m", "mpprefill", command, "--port", str(base), *flags]
    with socket.create_server((HOST, base + offset)):
        out = subprocess.run([*cmd, *COMMON_FLAGS], capture_output=True, text=True, timeout=120)
    line = f"mpprefill {command}: {flag} {base + offset} is in use"
    if offset:
        line += f" (derived from --port {base}); pass another --port or {flag}"
    else:
        line += "; pass another --port"
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_the_front_alone_on_a_port_in_use_is_one_line_too():
    base = free_base_port(())
    cmd = [sys.executable, "-m", "mpprefill.http", "--port", str(base)]
    with socket.create_server((HOST, base)):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    line = f"python -m mpprefill.http: --port {base} is in use; pass another --port\n"
    assert (out.returncode, out.stderr) == (2, line)
