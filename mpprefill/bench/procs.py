"""Start and stop the server and decode receiver processes of one bench run."""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import ipc
from mpprefill.server.client import Client

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A port free now, for a process to bind, outside the kernel's ephemeral range.

    NOTE: a ZeroMQ socket may connect before its server listens, and retries; were the
    port an ephemeral one, a retry could be given it as its own source port, and a TCP
    connection to itself then stands in for the server for good (on Linux about one in
    70,000 tries)."""
    ports = _non_ephemeral_ports()
    for _ in range(200):
        port = random.choice(ports)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port found in {ports}")


def free_base_port(offsets: Iterable[int]) -> int:
    """A port P free now, with P + each of `offsets` free too, all outside the kernel's
    ephemeral range (see free_port): for servers whose other ports derive from their
    --port (mpprefill.ports)."""
    offsets = sorted({0, *offsets})
    ports = _non_ephemeral_ports()
    low, high = ports.start - offsets[0], ports.stop - 1 - offsets[-1]
    if low > high:
        raise RuntimeError(f"offsets {offsets[0]}..{offsets[-1]} do not fit in {ports}")
    for _ in range(200):
        base = random.randint(low, high)
        if all(_bindable(base + o) for o in offsets):
            return base
    raise RuntimeError(f"no free port P in {low}..{high} with P + {offsets} free")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _non_ephemeral_ports() -> range:
    low, high = 32768, 60999  # Linux's defaults
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        pass
    below = range(10000, low)
    return below if len(below) >= 1000 else range(high + 1, 65536)


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM (a clean stop unlinks segments and sockets), SIGKILL if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(10)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    port: int  # its ZeroMQ socket
    log_path: str
    http_port: int | None = None  # serve's HTTP front, where it runs one

    def stop(self) -> int:
        return terminate(self.proc)

    def shm_left(self) -> list[str]:
        """Segments of this process still in /dev/shm (its own and its children's)."""
        return ipc.list_segments(f"mpp_{self.proc.pid}_") + ipc.list_segments(
            f"mppdecode_{self.proc.pid}_"
        )

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


# NOTE: serve's --port is its HTTP front's; the bench talks to its ZeroMQ socket and starts
# the front itself where it needs one (`--front http`).
SERVE_SOCKET_FLAGS = ("--disable-http-front", "--zmq-port")


def _start(
    name: str,
    flags: list[str],
    log_dir: str,
    timeout: float,
    probe,
    port_flags: tuple[str, ...],
    launcher: list[str] | None = None,
) -> Child:
    """Spawn `mpprefill name` (or `launcher`, a command taking its flags) with its socket
    on a free port, then call probe(client) until it stops timing out."""
    port = free_port()
    log_path = os.path.join(log_dir, f"{name}-{port}.log")
    launcher = launcher or [sys.executable, "-m", "mpprefill", name]
    cmd = [*launcher, *flags, *port_flags, str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    child = Child(name, proc, port, log_path)
    client = Client(f"127.0.0.1:{port}")
    try:
        _wait_ready(child, lambda: probe(client), timeout)
    finally:
        client.close()
    return child


def start_server(
    flags: list[str], log_dir: str, timeout: float = 120.0, http: bool = False
) -> Child:
    """`mpprefill serve` on a free --zmq-port; with `http`, its HTTP front on a free --port
    too, ready once /health answers."""
    if not http:
        probe = lambda client: client.stats(timeout=1.0)
        return _start("serve", flags, log_dir, timeout, probe, SERVE_SOCKET_FLAGS)
    http_port = free_port()
    probe = lambda client: client.stats(timeout=1.0) and _http_health(http_port)
    flags = [*flags, "--port", str(http_port)]
    child = _start("serve", flags, log_dir, timeout, probe, ("--zmq-port",))
    child.http_port = http_port
    return child


def _http_health(port: int) -> bool:
    """TimeoutError until the HTTP front answers GET /health with 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", "/health")
        if conn.getresponse().status == 200:
            return True
    except OSError:
        pass
    finally:
        conn.close()
    time.sleep(0.1)
    raise TimeoutError(f"no HTTP front on port {port} yet")


def start_decode(
    flags: list[str], log_dir: str, timeout: float = 120.0, launcher: list[str] | None = None
) -> Child:
    """A decode receiver without its HTTP front; `Child.port` is its receiver socket.
    `launcher`: a command that serves `mpprefill decode`'s flags (a test's, with hooks)."""
    flags = ["--zmq-port", "0", *flags]  # its request socket, unused here: any free port
    return _start("decode", flags, log_dir, timeout, _ping, ("--receiver-port",), launcher)


def _ping(client: Client) -> None:
    client.send({"type": "ping"})
    client.recv(timeout=1.0)


def _wait_ready(child: Child, probe, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with {child.proc.returncode}:\n{child.log_tail()}"
            )
        try:
            probe()
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                child.stop()
                raise RuntimeError(
                    f"{child.name} not ready after {timeout}s:\n{child.log_tail()}"
                ) from None


# ---- /proc inspection: children, the forward process, its ipc directory -------------------

RUNTIME_ENV = "MPP_IPC_RUNTIME_DIR"  # where a serve process keeps its ipc:// sockets


def children(pid: int) -> list[int]:
    """Child pids of every thread of `pid` (empty once it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    out = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def cmdline(pid: int) -> bytes:
    """`pid`'s command line, its arguments NUL-separated (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def front_pids(server_pid: int) -> list[int]:
    """The HTTP front children (`python -m mpprefill.http`) of a serve or decode process."""
    return [p for p in children(server_pid) if b"mpprefill.http" in cmdline(p)]


def forward_pids(serve_pid: int) -> list[int]:
    """The forward processes (one per tensor-parallel rank): the serve process's spawned
    children, not its resource tracker."""
    pids = []
    for child in children(serve_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    pids.append(child)
        except OSError:
            continue
    return pids


def worker_pid(serve_pid: int) -> int | None:
    """A forward process (the first listed where there are several ranks)."""
    pids = forward_pids(serve_pid)
    return pids[0] if pids else None


def runtime_dir_of(pid: int) -> str | None:
    """The ipc:// socket directory a process was given (its environment says)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    key = RUNTIME_ENV.encode() + b"="
    return next((e[len(key) :].decode() for e in env if e.startswith(key)), None)
