"""`mpprefill serve` on SIGINT/SIGTERM: the first stops it gracefully, a second at once.

The first signal only sets a flag: the loop stops taking requests, every request (live or
already on the socket) gets an error reply, the worker stops, every segment is unlinked,
and the process exits 0. A second signal skips all that: the worker stops at once
(`Worker.kill_now`: the forward process is killed, its segments and this process's are
unlinked, the channel's ipc:// socket file is removed), and the process exits with
128 + the signal number.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

import ipc

logger = logging.getLogger(__name__)


def install(on_first: Callable[[int], None], stop_now: Callable[[], None]) -> None:
    """`on_first(signum)` on the first signal; on the next, `stop_now()` then exit."""
    seen = []

    def on_signal(signum, frame):
        if seen:
            exit_now(stop_now, signum)
        seen.append(signum)
        on_first(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def exit_now(stop_now: Callable[[], None], signum: int) -> None:
    logger.warning("signal %d again: exiting at once", signum)
    with contextlib.suppress(Exception):
        stop_now()
    ipc.unlink_owned()
    os._exit(128 + signum)
