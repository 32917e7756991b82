"""The HTTP front as a child of `mpprefill serve`: spawned pointing at the serve's ZeroMQ
socket, tied to the serve's life, stopped with it.

The front is its own process (`python -m mpprefill.http`) so that HTTP parsing and
tokenization never take the scheduler's GIL. It is told the serve's pid and asks the
kernel for SIGTERM when that process exits (PR_SET_PDEATHSIG, `ipc.die_with_parent`), so
a serve killed at once does not leave it serving.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from mpprefill.config import ServerArgs

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0  # the front's graceful shutdown is 5 s


def front_command(args: ServerArgs) -> list[str]:
    """`python -m mpprefill.http` with serve's HTTP settings, pointed at its socket."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    cmd = [sys.executable, "-m", "mpprefill.http"]
    cmd += ["--zmq-address", f"{host}:{args.zmq_port}", "--host", args.host]
    cmd += ["--port", str(args.port), "--parent-pid", str(os.getpid())]
    cmd += ["--log-level", args.log_level]
    for flag, value in (
        ("--model-path", args.model_path),
        ("--tokenizer-path", args.tokenizer_path),
    ):
        if value is not None:
            cmd += [flag, value]
    if args.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd


class HttpFrontProcess:
    """The spawned front; `stop()` ends it (SIGTERM, then SIGKILL), `kill()` at once."""

    def __init__(self, args: ServerArgs):
        # NOTE: spawned from the serve's main thread, which lives as long as the serve:
        # the death signal follows the thread that started the child.
        self.proc = subprocess.Popen(front_command(args), stdin=subprocess.DEVNULL)
        logger.info("HTTP front (pid %d) on %s:%d", self.proc.pid, args.host, args.port)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the HTTP front did not stop within %gs; killed", STOP_TIMEOUT_S)
                self.proc.kill()
        return self.proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
