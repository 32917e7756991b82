"""What the chaos run needs beyond `mpprefill.bench.procs`: a hard kill, a decode receiver
restarted on its port, a generating decode server with its HTTP front, the server's stats,
and what a run left behind (segments, ipc:// files, HTTP fronts that outlived their
server)."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time

import ipc
from mpprefill.bench.procs import Child, children, free_port, start_decode
from mpprefill.server.client import Client


def alive(child: Child) -> bool:
    return child.proc.poll() is None


def kill(child: Child) -> int:
    """SIGKILL: no clean-up of its own, which is the fault being injected."""
    child.proc.kill()
    return child.proc.wait(10)


def restart_decode(
    port: int, flags: list[str], log_dir: str, timeout: float = 120.0, launcher=None
) -> Child:
    """A decode receiver on `port`: the rooms registered for it name that address
    (`procs.start_decode` always takes a fresh port). `launcher`: as start_decode's."""
    log_path = os.path.join(log_dir, f"decode-{port}-{int(time.time() * 1000)}.log")
    launcher = launcher or [sys.executable, "-m", "mpprefill", "decode"]
    cmd = [*launcher, *flags, "--receiver-port", str(port)]
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


def start_generating_decode(flags: list[str], log_dir: str, timeout: float = 120.0) -> Child:
    """A decode server with its HTTP front on a free port (`http_port`), ready once the
    front's /health answers."""
    port = free_port()
    child = start_decode([*flags, "--port", str(port)], log_dir, timeout)
    child.http_port = port
    deadline = time.monotonic() + timeout
    while not _healthy(port):
        if not alive(child) or time.monotonic() > deadline:
            if alive(child):
                kill(child)
            raise RuntimeError(f"the decode server's HTTP front is not up:\n{child.log_tail()}")
        time.sleep(0.2)
    return child


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def http_fronts(*owners: Child) -> list[int]:
    """Pids of the HTTP fronts these processes spawned (they must end with them)."""
    out = []
    for owner in owners:
        for pid in children(owner.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"mpprefill.http" in cmd:
                out.append(pid)
    return out


def stats(port: int, timeout: float = 5.0) -> dict | None:
    """One stats reply of the server, or None."""
    client = Client(f"127.0.0.1:{port}")
    try:
        return client.stats(timeout)
    except TimeoutError:
        return None
    finally:
        client.close()


def leftovers(
    serve: Child, decodes: list[Child], runtime_dir: str | None, fronts: list[int] = ()
) -> dict:
    """Shared segments and ipc:// socket files of this run that still exist, and HTTP
    fronts that outlived their server."""
    segments = [s for child in (serve, *decodes) for s in child.shm_left()]
    sockets = []
    if runtime_dir and os.path.isdir(runtime_dir):
        sockets = [os.path.join(runtime_dir, e) for e in os.listdir(runtime_dir)]
    return {
        "segments": segments,
        "ipc_files": sockets,
        "ipc_dir_left": bool(runtime_dir and os.path.isdir(runtime_dir)),
        "processes": [pid for pid in fronts if _running(pid)],
    }


def _running(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` still runs after up to `timeout` s (an exited, unreaped child does
    not count)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state in ("Z", "X") or time.monotonic() > deadline:
            return state not in ("Z", "X")
        time.sleep(0.1)


def sweep(serve: Child | None, decodes: list[Child]) -> None:
    """Remove the segments a killed process could not."""
    if serve is not None:
        ipc.remove_prefix(f"mpp_{serve.proc.pid}_")
    for child in decodes:
        ipc.remove_prefix(f"mppdecode_{child.proc.pid}_")
