from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import ipc
from mpprefill.bench.procs import SERVE_SOCKET_FLAGS, free_port, terminate
from mpprefill.server.client import Client


class ServerProc:
    def __init__(self, *flags: str, env: dict | None = None):
        self.port = free_port()
        cmd = [sys.executable, "-m", "mpprefill", "serve", *SERVE_SOCKET_FLAGS, str(self.port)]
        cmd += flags
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self.client = Client(f"127.0.0.1:{self.port}")
        self.client.stats(timeout=120)  # ready once it answers

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout)
        self.client.close()
        return rc

    def log(self) -> str:
        return self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""

    def shm_left(self) -> list[str]:
        return ipc.list_segments(f"mpp_{self.proc.pid}_")


@pytest.fixture
def server_factory():
    started: list[ServerProc] = []

    def start(*flags, env=None) -> ServerProc:
        s = ServerProc(*flags, env=env)
        started.append(s)
        return s

    yield start
    for s in started:
        terminate(s.proc)  # a clean stop removes its socket dir too
        ipc.remove_prefix(f"mpp_{s.proc.pid}_")
