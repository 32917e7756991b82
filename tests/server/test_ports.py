"""Servers on one host told apart by --port alone: two prefills and two decodes whose other
ports all derive from it; a port in use is one line and exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mpprefill.bench.procs import free_base_port  # noqa: E402
from mpprefill.ports import BOOTSTRAP_OFFSET, RECEIVER_OFFSET, ZMQ_OFFSET  # noqa: E402
from tests.http.helpers import Front  # noqa: E402

pytestmark = pytest.mark.timeout(300)
HOST = "127.0.0.1"
MAX_TOTAL_TOKENS = 4096
SERVE_FLAGS = ("--disaggregation-transfer-backend", "shm", "--forward-mode", "normal")
DECODE_FLAGS = ()
COMMON_FLAGS = ("--max-total-tokens", str(MAX_TOTAL_TOKENS), "--log-level", "warning")
# the prefills' --port is B and B + 1, the decodes' B + 2 and B + 3: every port derived
# from those must be free too
OFFSETS = [i + o for i in range(4) for o in (0, ZMQ_OFFSET, RECEIVER_OFFSET, BOOTSTRAP_OFFSET)]


class Server(Front):
    """`mpprefill serve|decode --port P` and its HTTP front, no other port given."""

    def __init__(self, command: str, port: int):
        self.port = port
        self.log = tempfile.NamedTemporaryFile(prefix=f"mpp-{command}-", suffix=".log")  # noqa: SIM115
        flags = SERVE_FLAGS if command == "serve" else DECODE_FLAGS
        cmd = [sys.executable, "-m", "mpprefill", command, "--port", str(port), *flags]
        self.proc = subprocess.Popen(
            [*cmd, *COMMON_FLAGS], stdout=self.log, stderr=subprocess.STDOUT
        )


@pytest.fixture(scope="module")
def cluster():
    """(prefills, decodes), all healthy, started together on --port alone."""
    base = free_base_port(OFFSETS)
    servers = [Server("serve", base), Server("serve", base + 1)]
    servers += [Server("decode", base + 2), Server("decode", base + 3)]
    try:
        for s in servers:
            s.wait_healthy(180)
        yield servers[:2], servers[2:]
    finally:
        for s in servers:
            s.kill()


def _listening(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=5).close()
    except OSError:
        return False
    return True


def test_two_prefills_and_two_decodes_run_given_port_alone(cluster):
    prefills, decodes = cluster
    for s in (*prefills, *decodes):
        status, info = s.get("/server_info")
        assert status == 200 and info["zmq_address"] == f"{HOST}:{s.port + ZMQ_OFFSET}"
    for s in prefills:
        assert _listening(s.port + BOOTSTRAP_OFFSET), "no bootstrap endpoint"
    for s in decodes:
        assert _listening(s.port + RECEIVER_OFFSET), "no receiver"


@pytest.mark.parametrize(
    ("command", "offset", "flag"),
    [
        ("serve", 0, "--port"),
        ("serve", ZMQ_OFFSET, "--zmq-port"),
        ("serve", BOOTSTRAP_OFFSET, "--disaggregation-bootstrap-port"),
        ("decode", 0, "--port"),
        ("decode", ZMQ_OFFSET, "--zmq-port"),
        ("decode", RECEIVER_OFFSET, "--receiver-port"),
    ],
)
def test_a_port_in_use_is_one_line_and_exit_status_2(command, offset, flag):
    base = free_base_port((ZMQ_OFFSET, RECEIVER_OFFSET, BOOTSTRAP_OFFSET))
    flags = SERVE_FLAGS if command == "serve" else DECODE_FLAGS
    cmd = [sys.executable, "-m", "mpprefill", command, "--port", str(base), *flags]
    with socket.create_server((HOST, base + offset)):
        out = subprocess.run([*cmd, *COMMON_FLAGS], capture_output=True, text=True, timeout=120)
    line = f"mpprefill {command}: {flag} {base + offset} is in use"
    if offset:
        line += f" (derived from --port {base}); pass another --port or {flag}"
    else:
        line += "; pass another --port"
    assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", "")


def test_the_front_alone_on_a_port_in_use_is_one_line_too():
    base = free_base_port(())
    cmd = [sys.executable, "-m", "mpprefill.http", "--port", str(base)]
    with socket.create_server((HOST, base)):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    line = f"python -m mpprefill.http: --port {base} is in use; pass another --port\n"
    assert (out.returncode, out.stderr) == (2, line)
