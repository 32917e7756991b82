"""A PD deployment behind SGLang's own router (the `sglang-router` package): one prefill,
two decode servers (one for the MoE checkpoints), the router in PD mode, all on loopback.
Every reply equals `transformers`' greedy `generate` on the checkpoint the servers load: a
dense Qwen2, a Mixtral mixture of experts, and DeepSeek-V3 (latent KV, grouped routing,
shared experts) from a prefill at two tensor-parallel ranks to a decode checking the latent
rows it receives (`--verify`)."""

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
from tests.e2e.checkpoint import (
    chat_ids,
    decode_text,
    encode,
    greedy_reference,
    reference_logprobs,
    save_checkpoint,
)

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

    def __init__(
        self,
        checkpoint: Path,
        num_decodes: int = 2,
        serve: tuple[str, ...] = (),
        decode: tuple[str, ...] = (),
    ):
        self.bootstrap_port = free_port()
        self.prefill_port = free_port()
        self.decode_ports = [free_port() for _ in range(num_decodes)]
        self.router_port = free_port()
        self.procs: list[Proc] = []
        try:
            self._start(("--model-path", str(checkpoint)), serve, decode)
        except BaseException:
            self.close()
            raise

    def _start(self, model: tuple[str, str], serve: tuple[str, ...], decode: tuple[str, ...]):
        py = sys.executable
        common = ("--page-size", "16", "--disaggregation-transfer-backend", "shm")
        quiet = ("--log-level", "warning")
        for port in self.decode_ports:
            self.procs.append(
                Proc(
                    *(py, "-m", "mpprefill", "decode", *model, *common, *quiet, *decode),
                    *("--port", str(port), "--zmq-port", "0"),
                    *("--receiver-port", str(free_port()), "--max-total-tokens", "8192"),
                )
            )
        self.procs.append(
            Proc(
                *(py, "-m", "mpprefill", "serve", *model, *common, *quiet, *serve),
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


MOE = {
    "MixtralForCausalLM": {},
    "DeepseekV3ForCausalLM": dict(serve=("--tp-size", "2"), decode=("--verify",)),
}


@pytest.mark.parametrize("arch", list(MOE))
def test_an_moe_family_equals_transformers(tmp_path, arch):
    """Prompt and decode both route through the experts. NOTE: first in the file, so that
    their deployments are gone before the module's starts."""
    checkpoint = save_checkpoint(tmp_path / arch, arch)
    d = Deployment(checkpoint, num_decodes=1, **MOE[arch])
    try:
        for text, n in ((TEXTS[0], 1), (TEXTS[1], 12)):
            ids = encode(checkpoint, text)
            (expected,) = greedy_reference(checkpoint, [ids], n)
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


# ---- the OpenAI routes, through the router, with the official client ---------------------

CHAT = [
    {"role": "system", "content": "numbers like 12 345"},
    {"role": "user", "content": "the prefill side computes the prompt"},
]


@pytest.fixture(scope="module")
def client(deployment):
    openai = pytest.importorskip("openai", reason="needs the openai client")
    return openai.OpenAI(
        base_url=f"http://{HOST}:{deployment.router_port}/v1", api_key="none", max_retries=0
    )


@pytest.fixture(scope="module")
def chat_reference(checkpoint):
    """The chat's prompt ids, transformers' greedy completion of them and its text."""
    ids = chat_ids(checkpoint, CHAT)
    (out,) = greedy_reference(checkpoint, [ids], MAX_NEW)
    return ids, out, decode_text(checkpoint, out)


def test_openai_chat_plain_and_streamed_equal_transformers(client, checkpoint, chat_reference):
    ids, out, text = chat_reference
    model = client.models.list().data[0].id
    assert model == str(checkpoint)
    r = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_NEW, temperature=0
    )
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if out[-1] == 2 else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out))
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_completion_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == text
    assert len([d for d in deltas if d]) > 1  # it came in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] is not None
    assert chunks[-1].usage.completion_tokens == len(out)


def test_openai_text_completion_equals_transformers(client, checkpoint):
    ids = encode(checkpoint, TEXTS[2])
    (out,) = greedy_reference(checkpoint, [ids], 10)
    r = client.completions.create(model="m", prompt=TEXTS[2], max_tokens=10, temperature=0)
    assert r.choices[0].text == decode_text(checkpoint, out)
    assert r.usage.completion_tokens == len(out)


def test_a_stop_string_ends_the_text_before_it(client, checkpoint):
    (out,) = greedy_reference(checkpoint, [encode(checkpoint, TEXTS[0])], MAX_NEW)
    text = decode_text(checkpoint, out)
    # a stop string that first occurs after the text's start
    at = next(k for k in range(2, len(text) - 2) if text.find(text[k : k + 2]) == k)
    stop = text[at : at + 2]
    r = client.completions.create(
        model="m", prompt=TEXTS[0], max_tokens=MAX_NEW, temperature=0, stop=stop
    )
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_are_each_the_seeded_request_alone(client):
    """n = 2 at temperature 1: choice i is the request with n = 1 and seed + i."""
    common = dict(model="m", messages=CHAT, max_tokens=6, temperature=1.0)
    both = client.chat.completions.create(n=2, seed=7, **common)
    assert [c.index for c in both.choices] == [0, 1]
    alone = [
        client.chat.completions.create(seed=7 + i, **common).choices[0].message.content
        for i in range(2)
    ]
    assert [c.message.content for c in both.choices] == alone


def test_logprobs_equal_transformers_log_softmax(client, checkpoint, chat_reference):
    ids, out, _ = chat_reference
    r = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    rows = reference_logprobs(checkpoint, ids, out[:6])
    assert len(content) == len(rows) == 6
    for entry, row, token in zip(content, rows, out[:6], strict=True):
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-3)
        best = row.topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=1e-3
        )
