"""Listening ports: how a server's auxiliary ports derive from `--port`, and checking them
before anything starts, with one line for a port that cannot be had.

Every TCP port `mpprefill serve` and `mpprefill decode` listen on, and the port a flag
left out takes:

    socket                      server         flag                             not given
    HTTP front                  serve, decode  --port                           serve 30000,
                                                                                decode 0: none
    ZeroMQ request socket       serve, decode  --zmq-port                       --port + 100
    decode receiver             decode         --receiver-port                  --port + 200
    prefill bootstrap endpoint  serve          --disaggregation-bootstrap-port  --port - 21002

At serve's default `--port` these are the old defaults (30100, and SGLang's 8998 for the
bootstrap endpoint); a decode without a front keeps its fixed 30201 and 30200. Servers
whose `--port` values lie within 100 of each other therefore share no port, so several
prefills and decodes run on one host given `--port` alone, as SGLang's servers do.

Each binds `--host`, except the ZeroMQ request socket, which binds `--zmq-host`: loopback
unless that flag says otherwise, as the socket takes generate, abort and flush_cache from
anyone who reaches it, with no key (the HTTP front, on this host, is the way in from
outside). The bootstrap endpoint and the decode receiver bind `--host` itself: every
interface only when it is a wildcard such as 0.0.0.0.

A server checks every port of its own when it starts (`check_free`), so a port in use
fails before a model loads; each is bound where it is used, a ZeroMQ bind inside
`binding` and the HTTP front's by the server (`listen_socket`), the front inheriting it,
so a port taken in between fails with the same line.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import zmq

DEFAULT_PORT = 30000  # serve's --port, SGLang's
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port
ZMQ_OFFSET = 100
RECEIVER_OFFSET = 200
BOOTSTRAP_OFFSET = DEFAULT_BOOTSTRAP_PORT - DEFAULT_PORT
MAX_PORT = 65535
EXIT_UNAVAILABLE = 2  # a server's exit status when a port of its cannot be had
BACKLOG = 2048  # uvicorn's


class Listen(NamedTuple):
    """One TCP port a server listens on: the flag that sets it, the port (0: any free one),
    and the `--port` it was derived from (None: given, or the flag's fixed default)."""

    flag: str
    port: int
    base: int | None = None

    @property
    def origin(self) -> str:
        return "" if self.base is None else f" (derived from --port {self.base})"

    @property
    def hint(self) -> str:
        """What the user can do about it."""
        if self.base is None:
            return f"pass another {self.flag}"
        return f"pass another --port or {self.flag}"


def derive(flag: str, given: int | None, port: int, offset: int) -> Listen:
    """`flag`'s port: as given, else `port + offset`."""
    if given is not None:
        return Listen(flag, given)
    return Listen(flag, port + offset, port)


def check_range(listen: Listen) -> None:
    """ValueError for a port no socket can bind (0, any free port, only when given)."""
    low = 1 if listen.base is not None else 0
    if not low <= listen.port <= MAX_PORT:
        raise ValueError(
            f"{listen.flag} {listen.port}{listen.origin} is outside {low}..{MAX_PORT};"
            f" {listen.hint}"
        )


class PortUnavailable(Exception):
    """A port a server cannot listen on; `line(prog)` says which, and what to do."""

    def __init__(self, listen: Listen, host: str, code: int | None, why: str | None):
        super().__init__(f"{listen.flag} {listen.port}: {why}")
        self.listen, self.host, self.code, self.why = listen, host, code, why

    def line(self, prog: str) -> str:
        listen = self.listen
        what = "is in use"
        if self.code != errno.EADDRINUSE:
            what = f"cannot be bound on {self.host} ({self.why})"
        return f"{prog}: {listen.flag} {listen.port} {what}{listen.origin}; {listen.hint}"


def report(e: PortUnavailable, prog: str) -> int:
    """Print `e`'s one line for the command `prog`; the exit status to leave with."""
    sys.stderr.write(e.line(prog) + "\n")
    return EXIT_UNAVAILABLE


def listen_socket(host: str, listen: Listen) -> socket.socket:
    """A TCP socket bound to `host:port` and listening, with SO_REUSEADDR as uvicorn and
    ZeroMQ bind theirs; PortUnavailable if it cannot be."""
    sock = None
    try:
        family, address = _address(host, listen.port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise PortUnavailable(listen, host, e.errno, e.strerror) from None
    return sock


def listen_or_close(host: str, listen: Listen, close: Callable[[], None]) -> socket.socket:
    """`listen_socket`, calling `close` first where the port was taken since the check at
    the start (what the server started must not outlive the failure)."""
    try:
        return listen_socket(host, listen)
    except PortUnavailable:
        close()
        raise


def check_free(binds: Iterable[tuple[str, Listen]]) -> None:
    """PortUnavailable for the first (host, port) of `binds` nothing could listen on now (a
    port 0 is any free one: not checked)."""
    for host, listen in binds:
        if listen.port != 0:
            listen_socket(host, listen).close()


@contextmanager
def binding(host: str, listen: Listen) -> Iterator[None]:
    """A ZeroMQ bind of `listen`'s port inside fails as PortUnavailable."""
    try:
        yield
    except zmq.ZMQError as e:
        raise PortUnavailable(listen, host, e.errno, e.strerror) from None


def _address(host: str, port: int) -> tuple[int, tuple]:
    """The family and address to bind `host:port`; '*' and '' are every interface."""
    name = None if host in ("*", "") else host.strip("[]")
    info = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = info[0]
    return family, address
