"""What each socket binds: the request socket loopback unless `--zmq-host` asks otherwise
(an outside address of this host cannot reach it by default), the bootstrap endpoint and
the decode receiver the host given, the advertised address naming it."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import subprocess
import sys
import threading

import pytest
import zmq

from mpprefill.bench.procs import free_port, terminate
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.disagg.bootstrap_server import BootstrapEndpoint
from mpprefill.ports import Listen
from mpprefill.server.client import Client

pytestmark = pytest.mark.timeout(90)


def non_loopback_address() -> str | None:
    """An IPv4 address of this host outside 127/8, or None."""
    candidates = []
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    for remote in ("10.254.254.254", "192.0.2.1", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, contextlib.suppress(OSError):
            s.connect((remote, 9))  # no packet is sent: the route names the address
            candidates.append(s.getsockname()[0])
    for address in candidates:
        ip = ipaddress.ip_address(address)
        if not (ip.is_loopback or ip.is_unspecified) and _bindable(address):
            return address
    return None


def _bindable(address: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def reachable(host: str, port: int) -> bool:
    """A TCP connection to `host:port` is accepted."""
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def address() -> str:
    found = non_loopback_address()
    if found is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    return found


def test_each_port_binds_its_own_host():
    args = ServerArgs(host="0.0.0.0", port=31000, disaggregation_transfer_backend="shm")
    assert args.binds == [
        ("0.0.0.0", Listen("--port", 31000)),
        ("127.0.0.1", Listen("--zmq-port", 31100, 31000)),
        ("0.0.0.0", Listen("--disaggregation-bootstrap-port", 9998, 31000)),
    ]
    decode = DecodeArgs(host="10.1.2.3", zmq_host="10.1.2.4", port=31001)
    assert decode.binds == [
        ("10.1.2.3", Listen("--port", 31001)),
        ("10.1.2.4", Listen("--zmq-port", 31101, 31001)),
        ("10.1.2.3", Listen("--receiver-port", 31201, 31001)),
    ]


def test_the_bootstrap_endpoint_binds_the_host_given(address):
    ctx = zmq.Context()
    endpoint = BootstrapEndpoint(ctx, address, 0, 1.0)
    try:
        bound = endpoint.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        assert bound == f"tcp://{address}:{endpoint.port}"
        assert reachable(address, endpoint.port)
        assert not reachable("127.0.0.1", endpoint.port)
    finally:
        endpoint.sock.close(linger=0)
        ctx.term()


class Decode:
    """A decode server in this process, serving on a thread."""

    def __init__(self, **kw):
        from mpprefill.decode.server import DecodeServer

        args = DecodeArgs(receiver_port=0, zmq_port=0, max_total_tokens=256, **kw)
        self.srv = DecodeServer(args)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.srv.stop()
        self.thread.join(10)
        self.srv.close()


def _stats(host: str, port: int) -> dict:
    client = Client(f"{host}:{port}")
    try:
        return client.stats(timeout=10)
    finally:
        client.close()


def test_a_decode_binds_its_receiver_on_host_and_its_request_socket_on_loopback(address):
    decode = Decode(host=address)
    srv = decode.srv
    try:
        assert srv.rx.sock.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://{address}:{srv.rx.port}"
        assert srv.rx.address == f"{address}:{srv.rx.port}"  # what it registers rooms with
        assert reachable(address, srv.rx.port) and not reachable("127.0.0.1", srv.rx.port)
        assert not reachable(address, srv.zmq_port)
        assert _stats("127.0.0.1", srv.zmq_port)["status"] == "stats"
    finally:
        decode.close()


def test_a_decode_request_socket_binds_zmq_host_when_asked(address):
    decode = Decode(zmq_host=address)
    try:
        assert _stats(address, decode.srv.zmq_port)["status"] == "stats"
        assert not reachable("127.0.0.1", decode.srv.zmq_port)
    finally:
        decode.close()


def test_a_prefill_request_socket_binds_zmq_host_when_asked(address):
    port = free_port()
    cmd = [sys.executable, "-m", "mpprefill", "serve", "--disable-http-front"]
    cmd += ["--zmq-port", str(port), "--zmq-host", address, "--log-level", "warning"]
    cmd += ["--disaggregation-transfer-backend", "fake", "--forward-mode", "normal"]
    cmd += ["--max-total-tokens", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _stats_within(address, port, 60)["status"] == "stats"
        assert not reachable("127.0.0.1", port)
    finally:
        terminate(proc)


def _stats_within(host: str, port: int, timeout: float) -> dict:
    client = Client(f"{host}:{port}")  # connects once the server binds
    try:
        return client.stats(timeout=timeout)
    finally:
        client.close()
