"""The forward process's two mailboxes, each served by a thread of its own.

Requests (Submit, Sample, Exit) and replies (Ready, Done, Failed) travel on two channels.
A receiving thread takes each request off its channel as soon as it arrives and prepares
it (`prepare`: for host staging slots, the slot's reads), while the forward thread still
runs the previous forward; a sending thread puts the replies. Between two forwards the
forward thread then only hands a reply over and picks the next request up.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import ipc
from mpprefill.worker.messages import Exit


class Inbox:
    """Requests in arrival order, each with what `prepare` made of it."""

    def __init__(self, ch: ipc.Channel, prepare: Callable[[Any], Any]):
        self.ch = ch
        self.prepare = prepare
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="requests", daemon=True)
        self._thread.start()

    def get(self, timeout: float | None = None) -> tuple[Any, Any]:
        """(request, prepared); raises what the receiving thread raised (PeerDied, ...),
        or queue.Empty after `timeout`."""
        item = self._items.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def _loop(self) -> None:
        try:
            while True:
                msg = self.ch.get()
                self._items.put((msg, self.prepare(msg)))
                if isinstance(msg, Exit):
                    return
        except BaseException as e:  # raised on the forward thread by get()
            self._items.put(e)


class Outbox:
    """Replies, put in order by a thread that may wait for the peer's slot."""

    def __init__(self, ch: ipc.Channel):
        self.ch = ch
        self.error: BaseException | None = None
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="replies", daemon=True)
        self._thread.start()

    def put(self, msg: Any) -> None:
        if self.error is not None:
            raise self.error
        self._items.put(msg)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        self._items.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (msg := self._items.get()) is not None:
            try:
                self.ch.put(msg)
            except BaseException as e:  # raised on the forward thread by the next put()
                self.error = e
                with contextlib.suppress(queue.Empty):
                    while self._items.get_nowait() is not None:
                        pass
                return
