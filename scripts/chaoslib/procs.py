"""What the chaos run needs beyond `mpprefill.bench.procs`: a hard kill, a decode receiver
restarted on the port serve keeps dialling, the server's stats, and what a run left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import ipc
from mpprefill.bench.procs import Child
from mpprefill.server.client import Client


def alive(child: Child) -> bool:
    return child.proc.poll() is None


def kill(child: Child) -> int:
    """SIGKILL: no clean-up of its own, which is the fault being injected."""
    child.proc.kill()
    return child.proc.wait(10)


def restart_decode(port: int, flags: list[str], log_dir: str, timeout: float = 120.0) -> Child:
    """A decode receiver on `port`: serve was started with that address and keeps it
    (`procs.start_decode` always takes a fresh port)."""
    log_path = os.path.join(log_dir, f"decode-{port}-{int(time.time() * 1000)}.log")
    cmd = [sys.executable, "-m", "mpprefill", "decode", *flags, "--receiver-port", str(port)]
    cmd += ["--zmq-port", "0"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    child = Child("decode", proc, port, log_path)
    _wait_pong(child, timeout)
    return child


def _wait_pong(child: Child, timeout: float) -> None:
    client = Client(f"127.0.0.1:{child.port}")
    deadline = time.monotonic() + timeout
    try:
        while alive(child) and time.monotonic() < deadline:
            client.send({"type": "ping"})
            try:
                if client.recv(0.5) == {"type": "pong"}:
                    return
            except TimeoutError:
                continue
    finally:
        client.close()
    if alive(child):
        kill(child)
    raise RuntimeError(f"restarted decode not ready:\n{child.log_tail()}")


def stats(port: int, timeout: float = 5.0) -> dict | None:
    """One stats reply of the server, or None."""
    client = Client(f"127.0.0.1:{port}")
    try:
        return client.stats(timeout)
    except TimeoutError:
        return None
    finally:
        client.close()


def leftovers(serve: Child, decodes: list[Child], runtime_dir: str | None) -> dict:
    """Shared segments and ipc:// socket files of this run that still exist."""
    segments = [s for child in (serve, *decodes) for s in child.shm_left()]
    sockets = []
    if runtime_dir and os.path.isdir(runtime_dir):
        sockets = [os.path.join(runtime_dir, e) for e in os.listdir(runtime_dir)]
    return {
        "segments": segments,
        "ipc_files": sockets,
        "ipc_dir_left": bool(runtime_dir and os.path.isdir(runtime_dir)),
    }


def sweep(serve: Child | None, decodes: list[Child]) -> None:
    """Remove the segments a killed process could not."""
    if serve is not None:
        ipc.remove_prefix(f"mpp_{serve.proc.pid}_")
    for child in decodes:
        ipc.remove_prefix(f"mppdecode_{child.proc.pid}_")
