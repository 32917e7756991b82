"""Run-time profiling of the forward process: a control socket its scheduler reaches.

`serve_control()` (one call in the forward process at start) runs a thread with a REP
socket at an ipc:// endpoint named after the process's pid, in the runtime dir both
processes share; the scheduler (`ProfileControl`) asks it to start the span tracer and
torch's profiler (which records the forward thread too) and to stop them and write their
files. The socket file is removed at exit and on SIGTERM; a process killed at once leaves
it in the runtime dir, which its creator removes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from typing import Any

import zmq

import ipc
from ipc.runtime import chain_signal
from mpprefill.trace.profiler import TorchProfile, TraceWindow, wants_torch

logger = logging.getLogger(__name__)
POLL_MS = 200
REPLY_TIMEOUT_S = 120.0  # a stop writes the torch trace first


def control_endpoint(pid: int) -> str:
    return ipc.ipc_endpoint(f"profile.{pid}")


class _Profiling:
    """What one start began; `stop` ends it and lists the files written."""

    def __init__(self, out_dir: str, activities: list[str]):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.window = TraceWindow("worker")
        self.torch = TorchProfile(activities, "worker") if wants_torch(activities) else None

    def stop(self) -> dict[str, Any]:
        files = {"trace": str(self.window.stop(self.out_dir))}
        if self.torch is not None:
            files["torch"] = str(self.torch.stop(self.out_dir))
        return files


class _ControlServer:
    def __init__(self):
        self.endpoint = control_endpoint(os.getpid())
        self.active: _Profiling | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="profile-control", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        finally:
            self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    sock.send_json(self._handle(sock.recv_json()))
        finally:
            sock.close(linger=0)  # an ipc:// socket removes its file on close
            ctx.term()

    def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            if req.get("cmd") == "start":
                if self.active is not None:
                    return {"ok": False, "error": "the forward process is profiling already"}
                self.active = _Profiling(req["output_dir"], req.get("activities", []))
                return {"ok": True}
            if req.get("cmd") == "stop":
                if self.active is None:
                    return {"ok": False, "error": "the forward process is not profiling"}
                active, self.active = self.active, None
                return {"ok": True, "files": active.stop()}
            return {"ok": False, "error": f"unknown command {req.get('cmd')!r}"}
        except Exception as e:  # a failed start or stop must not end the forward process
            logger.exception("profiling request failed")
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * POLL_MS / 1000 + 1)
        self.remove_socket()

    def remove_socket(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint.removeprefix("ipc://"))


def serve_control() -> None:
    """Start the control thread; it ends (and its socket file goes) when the process exits
    or gets SIGTERM. Call from the main thread."""
    server = _ControlServer()
    atexit.register(server.close)
    chain_signal(signal.SIGTERM, server.remove_socket)


class ProfileControl:
    """The scheduler's side: one request at a time to the forward process `pid`."""

    def __init__(self, pid: int):
        self.ctx = zmq.Context.instance()
        self.endpoint = control_endpoint(pid)

    def remove_endpoint(self) -> None:
        """Remove the control socket's file: the forward process is being killed at once
        and cannot (its runtime dir must be left empty)."""
        with contextlib.suppress(OSError):
            os.unlink(self.endpoint.removeprefix("ipc://"))

    def request(self, cmd: dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send_json(cmd)
            if not sock.poll(int(timeout * 1000)):
                return {"ok": False, "error": f"the forward process did not answer in {timeout}s"}
            return sock.recv_json()
        finally:
            sock.close(linger=0)
