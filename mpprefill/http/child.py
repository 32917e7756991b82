"""The HTTP front as a child of the server it fronts (`mpprefill serve` or `mpprefill
decode`): spawned pointing at that server's ZeroMQ socket, tied to its life, stopped with it.

The server binds the front's port itself, so that a port in use is its one line
(mpprefill.ports); the front inherits the listening socket (`--listen-fd`) and serves on it.

The front is its own process (`python -m mpprefill.http`) so that HTTP parsing and
tokenization never take the server's GIL. It is given the server's pid (`--parent-pid`) and
asks the kernel for SIGTERM when that process exits (PR_SET_PDEATHSIG, `ipc.die_with_parent`),
so a server killed at once does not leave it serving. The server's `--api-key` reaches the
front in its environment ($MPPREFILL_API_KEY, which the front also inherits from the server
when no flag was given), not on its command line, which `ps` shows to every user of the
host. This module loads no web framework.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import Protocol

from mpprefill.http.auth import API_KEY_ENV

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0  # the front's graceful shutdown is 5 s
WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")  # hosts that bind every interface


class FrontSettings(Protocol):
    """What the front takes from its server's arguments (ServerArgs and DecodeArgs have it)."""

    host: str
    port: int
    zmq_host: str
    api_key: str | None
    log_level: str
    model_path: str | None
    tokenizer_path: str | None
    skip_tokenizer_init: bool
    served_model_name: str | None
    chat_template: str | None


def builtin_vocab_size() -> int:
    """The built-in model's vocabulary (its front sizes a byte-level tokenizer to it)."""
    from mpprefill.model.config import ModelConfig

    return ModelConfig.tiny().vocab_size


def local_address(host: str, port: int) -> str:
    """Where a process on this host reaches a socket bound to `host:port`."""
    return f"127.0.0.1:{port}" if host in WILDCARDS else f"{host}:{port}"


def front_command(args: FrontSettings, zmq_port: int, listen_fd: int | None = None) -> list[str]:
    """`python -m mpprefill.http` with the server's HTTP settings, pointed at its socket;
    serving on the inherited socket `listen_fd`, where given."""
    cmd = [sys.executable, "-m", "mpprefill.http"]
    cmd += ["--zmq-address", local_address(args.zmq_host, zmq_port), "--host", args.host]
    cmd += ["--port", str(args.port), "--parent-pid", str(os.getpid())]
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
    cmd += ["--log-level", args.log_level]
    for flag, value in (
        ("--model-path", args.model_path),
        ("--tokenizer-path", args.tokenizer_path),
        ("--served-model-name", args.served_model_name),
        ("--chat-template", args.chat_template),
    ):
        if value is not None:
            cmd += [flag, value]
    if args.model_path is None:
        cmd += ["--vocab-size", str(builtin_vocab_size())]
    if args.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    return cmd


def front_env(api_key: str | None) -> dict[str, str]:
    """The front's environment: this process's, with $MPPREFILL_API_KEY the server's
    `--api-key` where given (else the front takes this process's $MPPREFILL_API_KEY, if
    any, as its key)."""
    env = dict(os.environ)
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    return env


class HttpFrontProcess:
    """The spawned front; `stop()` ends it (SIGTERM, then SIGKILL), `kill()` at once.
    `listener`: the front's socket, bound and listening, which it inherits (closed here)."""

    def __init__(self, args: FrontSettings, zmq_port: int, listener: socket.socket):
        # NOTE: spawn from the server's main thread, which lives as long as the server:
        # the death signal follows the thread that started the child.
        fd = listener.fileno()
        try:
            cmd = front_command(args, zmq_port, fd)
            env = front_env(args.api_key)
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(fd,), env=env)
        finally:
            listener.close()  # the front's copy is the one that serves
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
