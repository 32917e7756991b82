"""`mpprefill serve` on SIGINT/SIGTERM: the first stops it gracefully, a second at once.

The first signal only sets a flag: the loop stops taking requests, every request (live or
already on the socket) gets an error reply, the worker stops, every segment is unlinked,
and the process exits 0. A second signal skips all that: it kills the forward process,
unlinks this process's segments and the forward process's, removes the worker channel's
ipc:// socket file, and exits with 128 + the signal number.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

import ipc

logger = logging.getLogger(__name__)


def install(on_first: Callable[[int], None], worker_of: Callable[[], object | None]) -> None:
    """`on_first(signum)` on the first signal; `exit_now` with `worker_of()` on the next."""
    seen = []

    def on_signal(signum, frame):
        if seen:
            exit_now(worker_of(), signum)
        seen.append(signum)
        on_first(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def exit_now(worker, signum: int) -> None:
    logger.warning("signal %d again: exiting at once", signum)
    endpoint = getattr(getattr(worker, "channel", None), "endpoint", "")
    proc = getattr(worker, "proc", None)
    with contextlib.suppress(Exception):
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(1)
        if worker is not None:
            worker.close()  # its segments, and those the forward process left
    ipc.unlink_owned()
    _remove_ipc_file(endpoint)
    os._exit(128 + signum)


def _remove_ipc_file(endpoint: str) -> None:
    """The worker channel's socket file, and its runtime dir once empty."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint.removeprefix("ipc://")
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))
