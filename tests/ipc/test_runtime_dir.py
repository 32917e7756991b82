"""The ipc:// socket directory of a process killed at once is swept by the next one that
makes a directory; a live process's directory, and one made in another PID namespace,
are kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.runtime import pid_namespace

ROOT = Path(__file__).resolve().parents[2]
MAKE_DIR = "import ipc; print(ipc.runtime_dir(), flush=True)"
pytestmark = pytest.mark.timeout(60)


def _fresh_env() -> dict[str, str]:
    """The environment of a process tree of its own (no inherited runtime dir)."""
    return {k: v for k, v in os.environ.items() if k != "MPP_IPC_RUNTIME_DIR"}


def _start(code: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", code]
    pipe = subprocess.PIPE
    return subprocess.Popen(cmd, cwd=ROOT, env=_fresh_env(), stdin=pipe, stdout=pipe, text=True)


def _dir_of_another_namespace(like: str, pid: int) -> str:
    """A directory named as one made by `pid` in another PID namespace."""
    path = os.path.join(os.path.dirname(like), f"mpp-ipc-{pid}.{pid_namespace() + 1}-elsewhere")
    os.mkdir(path, 0o700)
    return path


def test_socket_dir_of_a_killed_process_is_swept():
    live = _start(MAKE_DIR + "; import sys; sys.stdin.read()")
    live_dir = live.stdout.readline().strip()
    killed = _start(MAKE_DIR + "; import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    dead_dir = killed.stdout.readline().strip()
    killed.wait(30)
    elsewhere = _dir_of_another_namespace(dead_dir, killed.pid)
    try:
        assert os.path.isdir(dead_dir) and os.path.isdir(live_dir)
        sweeper = _start(MAKE_DIR)
        own_dir = sweeper.stdout.readline().strip()
        assert sweeper.wait(30) == 0
        assert not os.path.exists(dead_dir)
        assert os.path.isdir(live_dir) and os.path.isdir(elsewhere)
        assert not os.path.exists(own_dir)  # removed at its creator's exit
    finally:
        live.kill()
        live.wait(30)
        shutil.rmtree(dead_dir, ignore_errors=True)
        shutil.rmtree(live_dir, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)
