"""A child learns of its parent's death from the kernel, not by polling a pid that a new
process may get."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

import ipc
from tests.ipc import children

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while ipc.pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_child_dies_with_its_parent_while_it_sleeps(ctx, endpoint, procs):
    ch = ipc.Channel(endpoint, bind=True)
    parent = ctx.Process(target=children.parent_of_watcher, args=(endpoint,))
    parent.start()
    procs.append(parent)
    child = ch.get(timeout=30).seq
    try:
        parent.kill()
        assert _gone(child, 5.0), "the child outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        ch.close()


def test_a_live_pid_that_is_not_the_parent_is_no_parent():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert ipc.pid_alive(other.pid)  # what polling a reused pid sees
        assert not ipc.parent_alive(other.pid)
        assert ipc.parent_alive(os.getppid())
    finally:
        other.kill()
        other.wait(10)
