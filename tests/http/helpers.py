"""Helpers of the HTTP front's tests: the front in a subprocess, and a stdlib HTTP client."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from mpprefill.bench.procs import free_port, terminate


class Front:
    """`python -m mpprefill.http` in a subprocess, logging to a file."""

    def __init__(self, zmq_port: int, *flags: str):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mpp-http-", suffix=".log")  # noqa: SIM115
        cmd = [
            sys.executable,
            *("-m", "mpprefill.http", "--zmq-address", f"127.0.0.1:{zmq_port}"),
            *("--port", str(self.port), "--log-level", "warning", *flags),
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    @classmethod
    def start(cls, *args, timeout: float = 90.0) -> Front:
        """`cls(*args)`, ready once /health answers 200 (the scheduler answered its stats)."""
        return cls(*args).wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 90.0) -> Front:
        """This front, once /health answers 200; killed if it does not in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the front exited early:\n{self.output()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError("the front did not become healthy")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | Iterable[bytes] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            chunked = body is not None and not isinstance(body, bytes)
            conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def post(self, path: str, obj: Any, timeout: float = 60.0) -> tuple[int, Any]:
        status, _, data = self.request("POST", path, json.dumps(obj).encode(), timeout=timeout)
        return status, json.loads(data) if data else None

    def get(self, path: str) -> tuple[int, Any]:
        status, _, data = self.request("GET", path)
        return status, json.loads(data) if data else None

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def kill(self) -> None:
        terminate(self.proc)
        self.log.close()


def sse_events(data: bytes) -> list[Any]:
    """The `data:` payloads of a server-sent event stream, [DONE] as the string."""
    text = data.decode()
    assert text.endswith("\n\n"), text
    out = []
    for event in text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        payload = event[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
