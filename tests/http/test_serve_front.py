"""`mpprefill serve` with its HTTP front: serve spawns the front on --port, pointed at its
--zmq-port; /metrics moves with the replies; the front ends with serve, also when serve is
killed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mpprefill.bench.procs import free_port, front_pids, terminate  # noqa: E402
from mpprefill.http.args import HttpArgs  # noqa: E402
from mpprefill.server.client import Client  # noqa: E402
from tests.http.helpers import Front  # noqa: E402

pytestmark = pytest.mark.timeout(240)
MAX_TOTAL_TOKENS = 8192


class ServeWithFront(Front):
    """`mpprefill serve` (fake transfer) and the front it spawns; `port` is the HTTP one."""

    def __init__(self, *flags: str):
        self.port, self.zmq_port = free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mpp-serve-", suffix=".log")  # noqa: SIM115
        cmd = [sys.executable, "-m", "mpprefill", "serve", "--forward-mode", "normal"]
        cmd += ["--port", str(self.port), "--zmq-port", str(self.zmq_port)]
        cmd += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def front_pid(self) -> int:
        (pid,) = front_pids(self.proc.pid)
        return pid


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def serve():
    s = ServeWithFront.start()
    yield s
    s.kill()


def _scrape(front: Front) -> dict[str, float]:
    status, headers, data = front.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            le = sample.labels.get("le")
            out[sample.name + (f"[{le}]" if le else "")] = sample.value
    return out


def test_serve_spawns_the_front_on_its_port_before_its_socket(serve):
    status, info = serve.get("/server_info")
    assert status == 200 and info["port"] == serve.port
    assert info["zmq_address"] == f"127.0.0.1:{serve.zmq_port}"
    client = Client(f"127.0.0.1:{serve.zmq_port}")  # the socket still takes its own clients
    try:
        assert client.stats()["forward_mode"] == "normal"
    finally:
        client.close()
    status, out = serve.post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {}})
    assert status == 200 and len(out["output_ids"]) == 1


def test_metrics_move_with_the_replies(serve):
    before = _scrape(serve)
    bodies = [{"input_ids": [9, 10, 11, 12] * (i + 1), "rid": f"m{i}"} for i in range(6)]
    bodies.append({"input_ids": [[5] * 40, [5] * 40 + [6]], "rid": ["mb0", "mb1"]})
    bodies.append({"input_ids": [7, 7, 7], "sampling_params": {"max_new_tokens": 0}})
    replies = []
    for body in bodies:
        status, out = serve.post("/generate", body)
        assert status == 200, out
        replies += out if isinstance(out, list) else [out]
    assert serve.post("/generate", {"input_ids": [1, 10**6]})[0] == 400  # outside the vocab
    after = _scrape(serve)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    metas = [r["meta_info"] for r in replies]
    assert delta("sglang:num_requests_total") == len(replies) == 9
    assert delta("sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("sglang:cached_tokens_total") == sum(m["cached_tokens"] for m in metas) > 0
    assert delta("sglang:generation_tokens_total") == sum(m["completion_tokens"] for m in metas)
    assert delta("sglang:generation_tokens_total") == len(replies) - 1  # max_new_tokens 0
    assert delta("mpprefill:num_failed_requests_total") == 1
    assert delta("sglang:e2e_request_latency_seconds_count") == len(replies)
    assert delta("sglang:time_to_first_token_seconds_count") == len(replies) - 1
    # the scheduler's figures: drained, every request it finished counted
    assert after["sglang:num_queue_reqs"] == after["sglang:num_running_reqs"] == 0
    assert after["sglang:num_prefill_inflight_queue_reqs"] == 0
    assert after["sglang:max_total_num_tokens"] == MAX_TOTAL_TOKENS
    assert after["sglang:num_used_tokens"] == after["sglang:token_usage"] == 0
    assert delta("mpprefill:finished_reqs_total") == len(replies)
    assert delta("mpprefill:failed_reqs_total") == 1
    assert delta("mpprefill:batches_total") >= 1
    assert 0 < after["sglang:cache_hit_rate"] < 1
    assert 0 <= after["mpprefill:forward_busy_fraction"] <= 1
    assert after["mpprefill:t_sched_ms"] > 0
    assert after["mpprefill:collective_seconds_total"] == 0  # no tensor-parallel collectives
    counters = serve.get("/server_info")[1]["internal_states"][0]["counters"]
    hit = counters["cached_tokens"] / counters["prompt_tokens"]
    assert after["sglang:cache_hit_rate"] == pytest.approx(hit)


def test_requests_whose_bootstrap_failed_are_counted():
    """A prefill with a bootstrap endpoint (shm transfer) where no decode ever registers
    the rooms: both requests fail in the bootstrap queue, and /metrics counts them there,
    not as failed transfers."""
    s = ServeWithFront.start(
        *("--disaggregation-transfer-backend", "shm", "--disaggregation-bootstrap-port", "0"),
        *("--bootstrap-timeout", "1"),
    )
    try:
        before = _scrape(s)
        body = {"input_ids": [[4, 5, 6], [7, 8, 9]], "bootstrap_room": [101, 102]}
        status, out = s.post("/generate", body)
        assert status == 500 and "bootstrap" in out["error"]["message"], out
        after = _scrape(s)
        name = "sglang:num_bootstrap_failed_reqs_total"
        assert before[name] == 0 and after[name] == 2
        assert after["sglang:num_transfer_failed_reqs_total"] == 0
        assert after["mpprefill:failed_reqs_total"] == 2
        assert after["sglang:num_prefill_prealloc_queue_reqs"] == 0
    finally:
        s.kill()


def test_the_front_ends_with_serve_on_sigterm_and_on_sigkill():
    for sig, code in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
        s = ServeWithFront.start()
        try:
            front = s.front_pid()
            s.proc.send_signal(sig)
            assert s.proc.wait(30) == code, s.output()
            assert _gone(front), f"the front outlived serve ({signal.Signals(sig).name})"
        finally:
            terminate(s.proc)
            s.log.close()


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"input_ids": [1, 2', "not JSON"),
        (b'{"input_ids": [1], "stream": "yes"}', "stream"),
        (b'{"input_ids": [1], "bootstrap_host": 7}', "bootstrap_host"),
        (b'{"input_ids": [1], "bootstrap_port": 0}', "bootstrap_port"),
        (b'{"input_ids": [1], "sampling_params": {"stop_token_ids": 2}}', "stop_token_ids"),
        (b'{"input_ids": [1], "sampling_params": {"ignore_eos": "no"}}', "ignore_eos"),
    ],
)
def test_malformed_bodies_are_400(serve, body, why):
    status, _, data = serve.request("POST", "/generate", body)
    assert status == 400 and why in data.decode(), data


def test_a_body_over_the_default_limit_is_413_and_the_front_keeps_serving(serve):
    limit = HttpArgs().max_body_bytes
    mib = b"1, " * ((1 << 20) // 3)
    chunks = [b'{"input_ids": [', *([mib] * (limit * 3 // (1 << 20) + 1)), b"1]}"]
    assert sum(map(len, chunks)) > limit
    status, _, data = serve.request("POST", "/generate", iter(chunks), timeout=120)
    assert status == 413, data
    status, out = serve.post("/generate", {"input_ids": [1, 2, 3]})
    assert status == 200, out
