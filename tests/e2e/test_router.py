"""A PD deployment behind SGLang's own router (the `sglang-router` package): one prefill,
two decode servers (one for the MoE checkpoint), the router in PD mode, all on loopback.
Every reply equals `transformers`' greedy `generate` on the checkpoint the servers load: a
dense Qwen2 and a Mixtral mixture of experts."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mpprefill.bench.procs import free_port, terminate
from tests.e2e.checkpoint import encode, greedy_reference, save_checkpoint

pytest.importorskip("sglang_router", reason="needs the sglang-router package")
pytest.importorskip("fastapi", reason="the HTTP fronts need the http extra")
pytestmark = pytest.mark.timeout(420)
HOST = "127.0.0.1"
MAX_NEW = 16


class Proc:
    """A command in a subprocess, its output in a file (a pipe could fill and block it)."""

    def __init__(self, *cmd: str):
        self.log = tempfile.NamedTemporaryFile(prefix="mpp-e2e-", suffix=".log")  # noqa: SIM115
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


def request(port: int, method: str, path: str, body=None, timeout: float = 120.0):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_http(port: int, path: str, procs: list[Proc], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.proc.poll() is None, f"exited early:\n{p.output()}"
        try:
            if request(port, "GET", path, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("\n".join(p.output() for p in procs))


class Deployment:
    """`num_decodes` decode servers and a prefill loading `checkpoint`, the router over them;
    a start that fails stops what it started."""

    def __init__(self, checkpoint: Path, num_decodes: int = 2):
        self.bootstrap_port = free_port()
        self.prefill_port = free_port()
        self.decode_ports = [free_port() for _ in range(num_decodes)]
        self.router_port = free_port()
        self.procs: list[Proc] = []
        try:
            self._start(("--model-path", str(checkpoint)))
        except BaseException:
            self.close()
            raise

    def _start(self, model: tuple[str, str]) -> None:
        py = sys.executable
        common = ("--page-size", "16", "--disaggregation-transfer-backend", "shm")
        quiet = ("--log-level", "warning")
        for port in self.decode_ports:
            self.procs.append(
                Proc(
                    *(py, "-m", "mpprefill", "decode", *model, *common, *quiet),
                    *("--port", str(port), "--zmq-port", "0"),
                    *("--receiver-port", str(free_port()), "--max-total-tokens", "8192"),
                )
            )
        self.procs.append(
            Proc(
                *(py, "-m", "mpprefill", "serve", *model, *common, *quiet),
                *("--forward-mode", "proc-ahead", "--worker-threads", "1"),
                *("--port", str(self.prefill_port), "--zmq-port", str(free_port())),
                *("--disaggregation-bootstrap-port", str(self.bootstrap_port)),
            )
        )
        for port in (*self.decode_ports, self.prefill_port):
            wait_http(port, "/health", self.procs)
        decodes = [a for p in self.decode_ports for a in ("--decode", f"http://{HOST}:{p}")]
        self.router = Proc(
            *(py, "-m", "sglang_router.launch_router", "--pd-disaggregation"),
            *("--prefill", f"http://{HOST}:{self.prefill_port}", str(self.bootstrap_port)),
            *decodes,
            *("--host", HOST, "--port", str(self.router_port), "--policy", "round_robin"),
        )
        self.procs.append(self.router)
        self._wait_router()

    def _wait_router(self, timeout: float = 120.0) -> None:
        """Until the router has its workers: a one-token request goes through."""
        deadline = time.monotonic() + timeout
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        while time.monotonic() < deadline:
            assert self.router.proc.poll() is None, self.router.output()
            try:
                if request(self.router_port, "POST", "/generate", body, timeout=30)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(self.router.output())

    def generate(self, body: dict):
        return request(self.router_port, "POST", "/generate", body)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("qwen2") / "ckpt", "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def deployment(checkpoint):
    d = Deployment(checkpoint)
    yield d
    d.close()


TEXTS = [
    "the prefill side computes the prompt",
    "pages of keys and values travel from one server to the other",
    "numbers like 12 345",
]


def greedy(n: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n}


def sse(data: bytes) -> list[dict]:
    events = []
    for line in data.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    return events


@pytest.fixture
def moe_checkpoint(tmp_path):
    return save_checkpoint(tmp_path / "mixtral", "MixtralForCausalLM")


def test_an_moe_family_equals_transformers(moe_checkpoint):
    """Mixtral through the router: prompt and decode both route through the experts.
    NOTE: first in the file, so that its deployment is gone before the module's starts."""
    d = Deployment(moe_checkpoint, num_decodes=1)
    try:
        for text, n in ((TEXTS[0], 1), (TEXTS[1], 12)):
            ids = encode(moe_checkpoint, text)
            (expected,) = greedy_reference(moe_checkpoint, [ids], n)
            status, raw = d.generate({"text": text, "sampling_params": greedy(n)})
            assert status == 200, raw
            assert json.loads(raw)["output_ids"] == expected, text
    finally:
        d.close()


def test_single_requests_text_and_ids_equal_transformers(deployment, checkpoint):
    for i, text in enumerate(TEXTS):
        n = 1 + 5 * i  # 1, 6, 11
        ids = encode(checkpoint, text)
        (expected,) = greedy_reference(checkpoint, [ids], n)
        status, raw = deployment.generate({"text": text, "sampling_params": greedy(n)})
        assert status == 200, raw
        reply = json.loads(raw)
        assert reply["output_ids"] == expected, (text, reply)
        meta = reply["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(expected)
        assert isinstance(reply["text"], str)
        status, raw = deployment.generate({"input_ids": ids, "sampling_params": greedy(MAX_NEW)})
        assert status == 200, raw
        (long,) = greedy_reference(checkpoint, [ids], MAX_NEW)
        assert json.loads(raw)["output_ids"] == long


def test_a_batch_of_ids_equals_transformers(deployment, checkpoint):
    """NOTE: the router's own body type takes `text` as one string only; a batch of texts
    is answered by the fronts themselves (tests/http), not through it."""
    ids = [encode(checkpoint, t) for t in TEXTS]
    expected = greedy_reference(checkpoint, ids, 8)
    status, raw = deployment.generate({"input_ids": ids, "sampling_params": greedy(8)})
    assert status == 200, raw
    assert [r["output_ids"] for r in json.loads(raw)] == expected


def test_streamed_replies_end_with_the_greedy_completion(deployment, checkpoint):
    ids = encode(checkpoint, TEXTS[1])
    (expected,) = greedy_reference(checkpoint, [ids], 12)
    body = {"input_ids": ids, "sampling_params": greedy(12), "stream": True}
    status, raw = deployment.generate(body)
    assert status == 200, raw
    events = sse(raw)
    assert events, raw
    assert events[-1]["output_ids"] == expected
    assert events[-1]["meta_info"]["finish_reason"] is not None
