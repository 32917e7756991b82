"""One-slot mailboxes between two processes over a ZeroMQ PAIR socket.

A ZeroMQ high-water mark of 1 still queues several messages, so capacity one is a
protocol here: every data frame is answered by an ack frame when the receiver
*takes* it (`get`), and `put` sends only once the previous message was taken.

`put` blocks until the peer has taken the previous message, up to its timeout,
then raises `MailboxFull`. `get` blocks up to its timeout, then raises
`MailboxTimeout`. Both check the peer's pid while they wait and raise `PeerDied`
within `_POLL_MS` (0.1 s) of its death (a peer that is this process's parent is checked
by `getppid`, which a reused pid cannot fool).

One `Channel` carries a mailbox in each direction (data one way, acks the other),
so a scheduler and its worker need one socket pair.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ipc import codec
from ipc.runtime import parent_alive, pid_alive

_DATA, _ACK = b"M", b"A"
_POLL_MS = 100  # longest wait between two checks of the peer's pid


class MailboxError(RuntimeError):
    pass


class MailboxFull(MailboxError):
    pass


class MailboxTimeout(MailboxError, TimeoutError):
    pass


class PeerDied(MailboxError):
    pass


class Channel:
    def __init__(
        self, endpoint: str, bind: bool, peer_pid: int | None = None, peer_is_parent: bool = False
    ):
        self.endpoint = endpoint
        self._sock = zmq.Context.instance().socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        (self._sock.bind if bind else self._sock.connect)(endpoint)
        self._peer_alive: Callable[[], bool] = lambda: True
        if peer_pid is not None:
            self.set_peer(peer_pid, peer_is_parent)
        self._inbox: deque[bytes] = deque()
        self._unacked = 0
        self.bytes_sent = 0
        self.bytes_recv = 0

    def set_peer(self, pid: int, is_parent: bool = False) -> None:
        """Watch `pid`; `is_parent` when it is this process's parent, whose death is then
        seen even once its pid belongs to another process."""
        self._peer_alive = (lambda: parent_alive(pid)) if is_parent else (lambda: pid_alive(pid))

    def put(self, msg: Any, timeout: float | None = None) -> None:
        """Send `msg` once the peer took the previous one (see module doc)."""
        data = codec.encode(msg)
        deadline = _deadline(timeout)
        while self._unacked:
            if not self._pump(deadline):
                raise MailboxFull(f"peer has not taken the previous message within {timeout}s")
        self._send(_DATA + data, deadline)
        self._unacked = 1
        self.bytes_sent += len(data)

    def get(self, timeout: float | None = None) -> Any:
        """Take the next message, freeing the peer's slot."""
        deadline = _deadline(timeout)
        while not self._inbox:
            if not self._pump(deadline):
                raise MailboxTimeout(f"no message within {timeout}s")
        data = self._inbox.popleft()
        # The message arrived intact; if the peer died since, the next call reports it.
        with contextlib.suppress(PeerDied):
            self._send(_ACK, None)
        return codec.decode(data)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message is ready to `get`."""
        if not self._inbox:
            self._pump(_deadline(timeout))
        return bool(self._inbox)

    def _send(self, frame: bytes, deadline: float | None) -> None:
        """Send without blocking forever: a PAIR socket with no peer would block."""
        while True:
            try:
                self._sock.send(frame, flags=zmq.NOBLOCK, copy=len(frame) < 65536)
                return
            except zmq.Again:
                pass
            wait = _POLL_MS if deadline is None else _remaining_ms(deadline, _POLL_MS)
            if self._sock.poll(wait, zmq.POLLOUT):
                continue
            if not self._peer_alive():
                raise PeerDied(f"peer of {self.endpoint} died")
            if deadline is not None and time.monotonic() >= deadline:
                raise MailboxFull(f"could not send within the timeout on {self.endpoint}")

    def _pump(self, deadline: float | None) -> bool:
        """Receive one frame; False on timeout. Checks the peer between poll slices."""
        while True:
            wait = _POLL_MS if deadline is None else _remaining_ms(deadline, _POLL_MS)
            if self._sock.poll(wait):
                self._recv_frame()
                return True
            if not self._peer_alive():
                raise PeerDied(f"peer of {self.endpoint} died")
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _recv_frame(self) -> None:
        frame = self._sock.recv(copy=True)
        kind, body = frame[:1], frame[1:]
        if kind == _ACK:
            self._unacked = 0
        elif kind == _DATA:
            if self._inbox:
                raise MailboxError("peer broke the one-slot protocol (two unacked messages)")
            self._inbox.append(body)
            self.bytes_recv += len(body)
        else:
            raise MailboxError(f"unknown frame kind {kind!r}")

    def close(self, linger_s: float = 0.0) -> None:
        """Close; `linger_s` lets frames already queued (a last error report) go out."""
        self._sock.close(linger=int(linger_s * 1000))


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def _remaining_ms(deadline: float, cap_ms: int) -> int:
    return max(0, min(cap_ms, int((deadline - time.monotonic()) * 1000) + 1))
