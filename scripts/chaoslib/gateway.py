"""The chaos run's router leg: SGLang's router in PD mode in front of serve's HTTP front and
a generating decode server, and the requests sent through it.

`Gateway` starts `python -m sglang_router.launch_router --pd-disaggregation` with retries,
the circuit breaker and health checks off (a fault must reach the client as it happened,
and a worker the router benched would fail requests no fault explains). `RouterLeg` posts
each request on a pool of threads and turns the router's answer into a reply shaped like
the protocol's (`status`, `first_token`, `output_ids`, ...) for the chaos checks; a
streamed answer is checked as it is read: every event's `output_ids` extends the one
before, and the last one is the whole output.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from chaoslib.workload import Record
from mpprefill.bench.procs import free_port, terminate

HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 120.0
SENDERS = 16  # threads posting requests; more wait their turn in the pool's queue


def unavailable() -> str | None:
    """Why the router leg cannot run here (None: it can)."""
    try:
        import sglang_router  # noqa: F401
    except ImportError as e:
        return f"sglang_router is not importable ({e}); pip install sglang-router"
    return None


class Gateway:
    """SGLang's router process: one prefill (HTTP `prefill_port`, its bootstrap endpoint on
    `bootstrap_port`), one decode (HTTP `decode_port`)."""

    def __init__(self, prefill_port: int, bootstrap_port: int, decode_port: int, log_dir: str):
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"router-{self.port}.log")
        cmd = [
            *(sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"),
            *("--prefill", f"http://{HOST}:{prefill_port}", str(bootstrap_port)),
            *("--decode", f"http://{HOST}:{decode_port}"),
            *("--host", HOST, "--port", str(self.port), "--policy", "round_robin"),
            *("--disable-retries", "--disable-circuit-breaker", "--disable-health-check"),
            *("--log-level", "warn"),
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until a one-token request goes through: the router has its workers."""
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if post(self.port, body, timeout=30)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"router not ready after {timeout}s:\n{self.tail()}")

    def stop(self) -> int:
        return terminate(self.proc)

    def tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def post(port: int, body: dict, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/generate", body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class RouterLeg:
    """Requests through the router, each on a thread of the pool; `finished()` hands back
    (record, reply) as they end."""

    def __init__(self, port: int):
        self.port = port
        self._pool = ThreadPoolExecutor(SENDERS, thread_name_prefix="router-leg")
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def send(self, rec: Record) -> None:
        self._pool.submit(self._run, rec)

    def finished(self) -> list[tuple[Record, dict]]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _run(self, rec: Record) -> None:
        body = {
            "input_ids": rec.prompt,
            "sampling_params": {"max_new_tokens": rec.max_new_tokens, "temperature": 0.0},
            "stream": rec.stream,
        }
        try:
            status, data = post(self.port, body, REQUEST_TIMEOUT_S)
            reply = to_reply(status, data, rec.stream)
        except Exception as e:  # a dropped connection, a timeout: the request's answer
            reply = {"status": "error", "error": f"router request failed: {e!r}"}
        self._done.put((rec, reply))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def to_reply(status: int, data: bytes, stream: bool) -> dict:
    """The router's answer as a protocol-shaped reply; `malformed` names what was wrong
    with a 200 answer's body or events."""
    if status != 200:
        return {"status": "error", "error": _error_text(data), "http_status": status}
    try:
        return _streamed(data) if stream else _body(json.loads(data))
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return {
            "status": "done",
            "malformed": f"{type(e).__name__}: {e}",
            "raw": data[:300].decode(errors="replace"),
        }


def _error_text(data: bytes) -> str:
    try:
        err = json.loads(data)["error"]
        return str(err["message"] if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")


def _body(body: dict, events: int = 0) -> dict:
    if "error" in body:
        return {"status": "error", "error": _error_text(json.dumps(body).encode())}
    ids = body["output_ids"]
    meta = body["meta_info"]
    return {
        "status": "done",
        "first_token": ids[0] if ids else None,
        "output_ids": ids,
        "finish_reason": meta["finish_reason"],
        "completion_tokens": meta["completion_tokens"],
        "events": events,
    }


def _streamed(data: bytes) -> dict:
    events = []
    for line in data.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            events.append(json.loads(line[5:]))
    if not events:
        raise ValueError("a stream without events")
    seen: list[int] = []
    for i, event in enumerate(events):
        if "error" in event:
            return _body(event)
        ids = event["output_ids"]
        if ids[: len(seen)] != seen or len(ids) < len(seen):
            raise ValueError(f"event {i}'s output_ids do not extend the ones before")
        last = i == len(events) - 1
        if (event["meta_info"]["finish_reason"] is None) == last:
            raise ValueError(f"event {i} of {len(events)}: finish_reason out of place")
        seen = ids
    return _body(events[-1], len(events))
