"""The decode server's HTTP front: `python -m mpprefill.http` as a child that dies with it.

`spawn_front` starts this module as `python -m mpprefill.disagg.decode.front PARENT_PID
<the front's flags>`; it asks the kernel for SIGTERM once the decode server exits (even by
SIGKILL: PR_SET_PDEATHSIG, ipc.die_with_parent), then runs `mpprefill.http` as `-m` would.
A launcher is used rather than a `preexec_fn`, which is unsafe in a process with threads
(ZeroMQ's, torch's).
"""

from __future__ import annotations

import logging
import runpy
import signal
import subprocess
import sys

import ipc
from mpprefill.disagg.decode.args import WILDCARDS

logger = logging.getLogger(__name__)


def local_address(host: str, port: int) -> str:
    """Where a process on this host reaches a socket bound to `host:port`."""
    return f"127.0.0.1:{port}" if host in WILDCARDS else f"{host}:{port}"


def front_command(args, zmq_port: int, parent_pid: int) -> list[str]:
    """The child's command line; `args`: DecodeArgs."""
    cmd = [sys.executable, "-m", __name__, str(parent_pid)]
    cmd += ["--zmq-address", local_address(args.host, zmq_port)]
    cmd += ["--host", args.host, "--port", str(args.port), "--log-level", args.log_level]
    if args.model_path is not None:
        cmd += ["--model-path", args.model_path]
    if args.tokenizer_path is not None:
        cmd += ["--tokenizer-path", args.tokenizer_path]
    if args.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd


def spawn_front(args, zmq_port: int, parent_pid: int) -> subprocess.Popen:
    """Start the front; call from the main thread (the death signal follows the thread
    that started the child, see ipc.die_with_parent)."""
    proc = subprocess.Popen(front_command(args, zmq_port, parent_pid))
    logger.info("HTTP front (pid %d) on %s:%d", proc.pid, args.host, args.port)
    return proc


def stop_front(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            logger.warning("HTTP front did not stop within %.0f s; killing it", timeout)
            proc.kill()
    proc.wait(timeout)


def main(argv: list[str]) -> int:
    parent, flags = int(argv[0]), argv[1:]
    if not ipc.die_with_parent(parent, signal.SIGTERM):
        return 1  # the decode server is gone already
    sys.argv = ["mpprefill.http", *flags]
    runpy.run_module("mpprefill.http", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
