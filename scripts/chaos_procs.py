"""The chaos run's processes: `mpprefill serve` and `mpprefill decode`, their kin and leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import zmq

import ipc
from mpprefill.bench.procs import (
    RUNTIME_ENV,
    free_port,
)


class Proc:
    """One child process with its log file; `stop` escalates SIGTERM to SIGKILL."""

    def __init__(self, name: str, args: list[str], log_dir: str, port: int):
        self.name, self.port = name, port
        self.log_path = os.path.join(log_dir, f"{name}-{port}-{int(time.time() * 1000)}.log")
        env = {k: v for k, v in os.environ.items() if k != RUNTIME_ENV}
        with open(self.log_path, "w") as log:
            cmd = [sys.executable, "-m", "mpprefill", *args, "--port", str(port)]
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, n: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])


def ping(port: int, message: dict, want, timeout: float) -> bool:
    """Send `message` until a reply satisfying `want` arrives, within `timeout` seconds."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            sock.send(json.dumps(message).encode())
            if sock.poll(500) and want(json.loads(sock.recv())):
                return True
        return False
    finally:
        sock.close(linger=0)


def start_decode(flags: list[str], log_dir: str, port: int | None = None) -> Proc:
    proc = Proc("decode", ["decode", *flags], log_dir, port or free_port())
    _wait(proc, lambda t: ping(proc.port, {"type": "ping"}, lambda r: r == {"type": "pong"}, t))
    return proc


def start_serve(flags: list[str], log_dir: str) -> Proc:
    proc = Proc("serve", ["serve", *flags], log_dir, free_port())
    stats = {"type": "stats"}
    _wait(proc, lambda t: ping(proc.port, stats, lambda r: r.get("status") == "stats", t))
    return proc


def _wait(proc: Proc, probe, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        if probe(2.0):
            return
    proc.stop(signal.SIGKILL)
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.log_tail()}")


def leftovers(serve_pid: int, decode_pids: list[int], runtime_dir: str | None) -> dict:
    """Shared segments and ipc:// socket files of this run that still exist."""
    segments = ipc.list_segments(f"mpp_{serve_pid}_")
    for pid in decode_pids:
        segments += ipc.list_segments(f"mppdecode_{pid}_")
    sockets = []
    if runtime_dir and os.path.isdir(runtime_dir):
        sockets = [os.path.join(runtime_dir, e) for e in os.listdir(runtime_dir)]
    return {
        "segments": segments,
        "ipc_files": sockets,
        "ipc_dir_left": bool(runtime_dir and os.path.isdir(runtime_dir)),
    }


def stats(port: int, timeout: float = 5.0) -> dict | None:
    """One stats reply of the server, or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(b'{"type": "stats"}')
        deadline = time.monotonic() + timeout
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            reply = json.loads(sock.recv())
            if reply.get("status") == "stats":
                return reply
        return None
    finally:
        sock.close(linger=0)
