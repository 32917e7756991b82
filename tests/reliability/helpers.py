"""Helpers of the reliability tests: a serve process with a log file, and /proc lookups."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

import ipc
from mpprefill.bench.procs import (
    RUNTIME_ENV,
    SERVE_SOCKET_FLAGS,
    free_port,
    runtime_dir_of,
    terminate,
    worker_pid,
)
from mpprefill.server.client import Client


class Serve:
    """`mpprefill serve` in a subprocess, logging to a file (a pipe could fill and block it)."""

    def __init__(self, *flags: str, command: str = "serve"):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix=f"mpp-{command}-", suffix=".log")  # noqa: SIM115
        env = {k: v for k, v in os.environ.items() if k != RUNTIME_ENV}
        port_flags = SERVE_SOCKET_FLAGS if command == "serve" else ("--port",)
        cmd = [sys.executable, "-m", "mpprefill", command, *port_flags, str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.runtime_dir: str | None = None  # its ipc:// socket dir, once started

    @classmethod
    def start(cls, *flags: str, timeout: float = 120.0) -> Serve:
        s = cls(*flags)
        client = s.client()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                assert s.proc.poll() is None, f"serve exited early:\n{s.output()}"
                try:
                    client.stats(timeout=1.0)
                    worker = s.worker_pid()
                    s.runtime_dir = runtime_dir_of(worker) if worker else None
                    return s
                except TimeoutError:
                    continue
            raise TimeoutError(f"serve not ready:\n{s.output()}")
        finally:
            client.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self) -> Client:
        return Client(f"127.0.0.1:{self.port}", ctx=zmq.Context.instance())

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def segments(self) -> list[str]:
        return ipc.list_segments(f"mpp_{self.pid}_")

    def worker_pid(self) -> int | None:
        return worker_pid(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Stop it (SIGTERM, then SIGKILL) and remove whatever it left behind."""
        terminate(self.proc)
        ipc.remove_prefix(f"mpp_{self.pid}_")
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.log.close()


def pid_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not ipc.pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1])


def dealer(port: int, ctx: zmq.Context | None = None) -> zmq.Socket:
    sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def recv_json(sock: zmq.Socket, timeout: float) -> dict | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return json.loads(sock.recv())


def wait_live(client: Client, n: int, timeout: float = 10.0) -> dict:
    """The server's stats once it holds `n` live requests (stats are answered while a poll
    reads, before the scheduler takes in a generate read in the same poll)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if stats["queues"]["live"] == n or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
