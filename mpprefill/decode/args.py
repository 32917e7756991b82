"""The decode server's settings: one frozen dataclass whose fields are the flags of
`mpprefill decode` (mpprefill.flags).

Its sockets: `--receiver-port` the receiver (prefill transfer backends, a registering
router), `--zmq-port` the request protocol (protocol.py) for clients and the HTTP
front, `--port` the HTTP front (SGLang's meaning; 0: none). With a front, the other two
derive from `--port` when not given (mpprefill.ports); without one they are fixed. The
receiver and the front bind `--host`; the request socket binds `--zmq-host`, loopback
unless asked otherwise."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from mpprefill import ports
from mpprefill.config import (
    API_KEY_HELP,
    DTYPES,
    LOOPBACK,
    ZMQ_HOST_HELP,
    ServerArgs,
    secret_field,
)
from mpprefill.disagg import wire
from mpprefill.disagg.backends import DECODE_BACKENDS
from mpprefill.flags import option
from mpprefill.http.child import WILDCARDS
from mpprefill.ports import Listen

DECODE_DEVICES = ("auto", "cpu", "cuda")
RECEIVER_PORT = 30200  # --receiver-port without an HTTP front (--port 0)
ZMQ_PORT = 30201  # --zmq-port without an HTTP front


def _server(name: str):
    """The server's flag of that name: same default and help (the verify model's)."""
    f = ServerArgs.__dataclass_fields__[name]
    return option(f.default, **f.metadata)


@dataclass(frozen=True)
class DecodeArgs:
    host: str = option(
        LOOPBACK, "address the receiver and the HTTP front bind to (the request socket: --zmq-host)"
    )
    advertise_host: str | None = option(
        None,
        "host the prefills are told to send KV to (this receiver's address when it registers"
        " a room); default --host, or this machine's host name resolved when --host is a"
        " wildcard such as 0.0.0.0",
    )
    port: int = option(
        0,
        "HTTP port: start the HTTP front (python -m mpprefill.http) on it (0: no front);"
        " --zmq-port and --receiver-port derive from it when not given",
    )
    receiver_port: int | None = option(
        None,
        "port of the receiver socket, where prefill transfer backends (and a registering"
        " router) talk to this decode (0: any free port); default --port + 200, or"
        f" {RECEIVER_PORT} without a front",
    )
    zmq_port: int | None = option(
        None,
        "port of the request socket (generate, abort, stats; 0: any free port); default"
        f" --port + 100, or {ZMQ_PORT} without a front",
    )
    zmq_host: str = option(LOOPBACK, ZMQ_HOST_HELP)
    api_key: str | None = secret_field(API_KEY_HELP)
    page_size: int = option(16, "tokens per receive page")
    max_total_tokens: int = option(16384, "receive pool capacity in tokens")
    model_path: str | None = option(
        None, "model dir (its dims size the pool; it generates; --verify runs it)"
    )
    tokenizer_path: str | None = option(
        None, "the HTTP front's tokenizer dir (default: the model's)"
    )
    served_model_name: str | None = option(
        None, "the model's name in the OpenAI routes and /v1/models (default: --model-path)"
    )
    chat_template: str | None = option(
        None, "the chat template of /v1/chat/completions: a jinja file or the template itself"
    )
    skip_tokenizer_init: bool = option(False, "the HTTP front takes and gives token ids only")
    max_running_requests: int = option(64, "sequences in one decode step; more wait their turn")
    random_seed: int = option(0, "seed of the built-in model's weights")
    verify: bool = option(False, "recompute each prompt's KV and compare it to what arrived")
    sliding_window: int | None = _server("sliding_window")
    swa_layers: str | None = _server("swa_layers")
    dtype: str = _server("dtype")
    kv_cache_dtype: str = _server("kv_cache_dtype")
    emulate_model: str | None = option(
        None,
        "the prefill side runs --device emulated with this --emulate-model: size the pool"
        " for its stand-in model",
    )
    disaggregation_transfer_backend: str = option("shm", "how KV arrives", choices=DECODE_BACKENDS)
    device: str = option(
        "auto",
        "where the decode generates: the CPU, as its KV pool is the host memory the prefills'"
        " transfers write into (auto: cpu; a CUDA decode is not built, cuda is refused)",
        choices=DECODE_DEVICES,
    )
    register_timeout: float = option(30.0, "seconds a registration may wait for free pages")
    max_queued_registrations: int = option(4096, "registrations waiting for pages beyond this fail")
    waiting_timeout: float = option(600.0, "seconds a room with pages may wait for all its KV")
    log_level: str = option("info", "logging level")

    def __post_init__(self):
        if self.device == "auto":  # NOTE: resolved once, here, as ServerArgs resolves it
            object.__setattr__(self, "device", "cpu")
        if self.device != "cpu":
            raise ValueError(
                f"--device {self.device}: the decode generates on the CPU (its KV pool is the"
                " host memory the prefills' transfers write into); give --device auto or cpu"
            )
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page of --page-size")
        if self.disaggregation_transfer_backend not in DECODE_BACKENDS:
            raise ValueError(f"--disaggregation-transfer-backend: one of {DECODE_BACKENDS}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"--sliding-window must be positive, got {self.sliding_window}")
        for name, value in (("dtype", self.dtype), ("kv-cache-dtype", self.kv_cache_dtype)):
            if value not in DTYPES:
                raise ValueError(f"--{name}: one of {DTYPES}, got {value!r}")
        if min(self.register_timeout, self.waiting_timeout) <= 0:
            raise ValueError("--register-timeout and --waiting-timeout must be positive")
        if self.max_queued_registrations < 0:
            raise ValueError("--max-queued-registrations must not be negative")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be positive")
        if self.api_key == "":
            raise ValueError("--api-key must not be empty")
        for listen in (Listen("--port", self.port), self.zmq_listen, self.receiver_listen):
            ports.check_range(listen)
        if self.verify and self.emulate_model is not None:
            raise ValueError("--verify cannot check KV from an emulated device (not the model's)")
        if self.advertise_host is not None:
            _check_advertise_host(self.advertise_host)

    @property
    def http_listen(self) -> Listen | None:
        """The HTTP front's port; None without a front."""
        return Listen("--port", self.port) if self.port else None

    @property
    def zmq_listen(self) -> Listen:
        return self._derive("--zmq-port", self.zmq_port, ports.ZMQ_OFFSET, ZMQ_PORT)

    @property
    def receiver_listen(self) -> Listen:
        flag, given = "--receiver-port", self.receiver_port
        return self._derive(flag, given, ports.RECEIVER_OFFSET, RECEIVER_PORT)

    @property
    def listens(self) -> list[Listen]:
        """Every port this decode listens on: its HTTP front's (where it has one), the
        request socket's and the receiver's."""
        front = [self.http_listen] if self.http_listen is not None else []
        return [*front, self.zmq_listen, self.receiver_listen]

    @property
    def binds(self) -> list[tuple[str, Listen]]:
        """Each port of `listens` with the host it binds: --zmq-host for the request socket,
        --host for the others."""
        zmq = self.zmq_listen
        return [(self.zmq_host if listen == zmq else self.host, listen) for listen in self.listens]

    def _derive(self, flag: str, given: int | None, offset: int, fixed: int) -> Listen:
        if given is None and not self.port:
            return Listen(flag, fixed)
        return ports.derive(flag, given, self.port, offset)

    @property
    def advertised_host(self) -> str:
        """The host the prefills are told to reach this decode's receiver at."""
        if self.advertise_host is not None:
            return self.advertise_host
        if self.host in WILDCARDS:
            return socket.gethostbyname(socket.gethostname())
        return self.host


def _check_advertise_host(host: str) -> None:
    if host in WILDCARDS:
        raise ValueError(
            f"--advertise-host {host!r} is a wildcard: give a host the prefills can reach"
            " this decode at"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(
            f"--advertise-host {host!r}: give a host without a port (the port is"
            " --receiver-port's); an IPv6 address goes in brackets"
        )
    if not wire.ADDRESS_RE.fullmatch(f"{host}:1"):
        raise ValueError(f"--advertise-host {host!r} is not a host name or address")
