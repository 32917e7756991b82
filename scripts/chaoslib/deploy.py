"""A PD deployment on this host, as scripts/launch.sh starts one: a prefill (`mpprefill
serve`, HTTP front, shm transfer, its bootstrap endpoint), N generating decodes, and
SGLang's router in PD mode over them. Each server keeps its HTTP and bootstrap ports
across a SIGKILL and restart, so the router's worker list stays right; `pids()` names every
process of the deployment for /proc readings (RSS, open descriptors)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time

import ipc
from mpprefill.bench.procs import forward_pids, free_port, front_pids, terminate

HOST = "127.0.0.1"
# NOTE: the recovery settings (README, "Deploy behind SGLang's router"; scripts/launch.sh).
# No retries: a retry of a request whose decode died waits out the prefill's
# --bootstrap-timeout first (its prefill half still waits for that decode), so it would
# answer after 30 s at best; without, it fails at once. No circuit breaker: it benched a
# restarted, healthy worker. A health check every second takes a dead worker (refused at
# once) out of the rotation after two failures and puts it back after one success; the
# check's timeout stays 5 s, as a busy server's /health can take over a second.
ROUTER_FLAGS = (
    *("--disable-retries", "--disable-circuit-breaker", "--health-check-interval-secs", "1"),
    *("--health-failure-threshold", "2", "--health-success-threshold", "1"),
)


class Server:
    """One `mpprefill serve` or `mpprefill decode` on fixed ports; `kill` then `start`
    brings it back where the router expects it."""

    def __init__(self, role: str, cmd: list[str], http_port: int, log_dir: str):
        self.role = role
        self.cmd = cmd
        self.http_port = http_port
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.past: list[int] = []  # pids of earlier lives (their segments are swept)
        self.log_path = ""

    def start(self) -> None:
        if self.proc is not None:
            self.past.append(self.proc.pid)
        self.log_path = os.path.join(
            self.log_dir, f"{self.role}-{self.http_port}-{len(self.past)}.log"
        )
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not healthy(self.http_port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} :{self.http_port} not up:\n{self.tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server and what it started (its front and forward process die with
        it by the parent-death signal; killed here too so none outlives the test)."""
        pids = self.pids()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        for pid in pids.values():
            _kill_quietly(pid)

    def stop(self) -> int:
        return terminate(self.proc) if self.proc is not None else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> dict[str, int]:
        """{name: pid} of the server, its forward processes and its HTTP front."""
        if not self.alive():
            return {}
        pid = self.proc.pid
        out = {self.role: pid}
        for i, fwd in enumerate(forward_pids(pid)):
            out[f"{self.role}-forward{i or ''}"] = fwd
        for child in front_pids(pid):
            out[f"{self.role}-front"] = child
        return out

    def segments(self) -> list[str]:
        """Shared segments of this server's current life."""
        if self.proc is None:
            return []
        pid = self.proc.pid
        return ipc.list_segments(f"mpp_{pid}_") + ipc.list_segments(f"mppdecode_{pid}_")

    def sweep(self, current: bool = False) -> list[str]:
        """Remove (and name) what earlier, killed lives left in /dev/shm (with `current`,
        the present life's too: it is over)."""
        left = []
        lives = [*self.past, self.proc.pid] if current and self.proc is not None else self.past
        for pid in lives:
            for prefix in (f"mpp_{pid}_", f"mppdecode_{pid}_"):
                left += ipc.list_segments(prefix)
                ipc.remove_prefix(prefix)
        return left

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class Deployment:
    """A prefill, `num_decodes` decodes and the router (`router_flags`) over them."""

    def __init__(
        self,
        log_dir: str,
        num_decodes: int = 2,
        router_flags: tuple[str, ...] = ROUTER_FLAGS,
        serve_flags: tuple[str, ...] = (),
    ):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.bootstrap_port = free_port()
        self.router_port = free_port()
        self.router_flags = router_flags
        py = sys.executable
        common = ["--page-size", "16", "--disaggregation-transfer-backend", "shm"]
        common += ["--log-level", "warning"]
        port = free_port()
        self.prefill = Server(
            "prefill",
            [
                *(py, "-m", "mpprefill", "serve", *common, "--port", str(port)),
                *("--zmq-port", str(free_port()), "--forward-mode", "proc-ahead"),
                *("--worker-threads", "1", "--check-invariants"),
                *("--disaggregation-bootstrap-port", str(self.bootstrap_port)),
                *serve_flags,
            ],
            port,
            log_dir,
        )
        self.decodes = []
        for i in range(num_decodes):
            port = free_port()
            cmd = [py, "-m", "mpprefill", "decode", *common, "--port", str(port)]
            cmd += ["--zmq-port", "0", "--receiver-port", str(free_port())]
            cmd += ["--max-total-tokens", "16384"]
            self.decodes.append(Server(f"decode{i}", cmd, port, log_dir))
        self.router: subprocess.Popen | None = None

    @property
    def servers(self) -> list[Server]:
        return [self.prefill, *self.decodes]

    def start(self) -> None:
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_healthy()
        self.start_router()

    def start_router(self) -> None:
        decodes = [a for d in self.decodes for a in ("--decode", f"http://{HOST}:{d.http_port}")]
        cmd = [
            *(sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"),
            *("--prefill", f"http://{HOST}:{self.prefill.http_port}", str(self.bootstrap_port)),
            *decodes,
            *("--host", HOST, "--port", str(self.router_port), "--policy", "round_robin"),
            *("--prometheus-port", str(free_port()), "--log-level", "warn"),
            *self.router_flags,
        ]
        self.router_log = os.path.join(self.log_dir, f"router-{self.router_port}.log")
        with open(self.router_log, "w") as log:
            self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.wait_router()

    def wait_router(self, timeout: float = 120.0) -> None:
        """Until a one-token request goes through the router."""
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited with {self.router.returncode}")
            try:
                if post(self.router_port, "/generate", body, timeout=30)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"router not ready after {timeout}s")

    def pids(self) -> dict[str, int]:
        out = {}
        if self.router is not None and self.router.poll() is None:
            out["router"] = self.router.pid
        for s in self.servers:
            out |= s.pids()
        return out

    def stop(self) -> dict[str, int]:
        """SIGTERM each process, the router first; {name: exit status}."""
        exits = {}
        if self.router is not None:
            exits["router"] = terminate(self.router)
        for s in self.servers:
            exits[s.role] = s.stop()
        return exits

    def cleanup(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.kill()
            self.router.wait(10)
        for s in self.servers:
            if s.alive():
                s.kill()
            s.sweep(current=True)


def drain(servers: list[Server], timeout: float = 60.0) -> dict[str, dict]:
    """{role: what it still holds} once no server holds anything, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        states = {s.role: server_state(s.http_port) or {} for s in servers}
        held = {role: leftover(st) for role, st in states.items()}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def leftover(state: dict) -> dict:
    """What a server still holds: requests, KV tokens, rooms, failed invariants."""
    load = state.get("load", {})
    out = {k: load[k] for k in ("num_reqs", "num_tokens") if load.get(k)}
    for k in ("rooms", "pending", "draining", "requests"):
        if state.get(k):
            out[k] = state[k]
    if "free_pages" in state and state["free_pages"] != state["num_pages"]:
        out["pages_held"] = state["num_pages"] - state["free_pages"]
    inv = state.get("invariants", {})
    if inv.get("checked") and not inv.get("ok"):
        out["invariants"] = inv.get("error")
    return out if state else {"unreachable": True}


def healthy(port: int) -> bool:
    try:
        return get(port, "/health", timeout=2.0)[0] == 200
    except OSError:
        return False


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post(port: int, path: str, body: dict, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def server_state(port: int) -> dict | None:
    """The server's stats (`internal_states` of /get_server_info), or None."""
    try:
        status, data = get(port, "/get_server_info", timeout=10.0)
    except OSError:
        return None
    return json.loads(data)["internal_states"][0] if status == 200 else None


def proc_usage(pid: int) -> tuple[int, int] | None:
    """(RSS in KiB, open file descriptors) of `pid` from /proc, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
