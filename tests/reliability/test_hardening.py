"""Hardened sockets: no pickle, private ipc dir, 0600 segments, loopback binds, frame caps."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest

from ipc.codec import MessageError
from mpprefill import protocol
from tests.reliability.helpers import Serve, dealer, recv_json, runtime_dir_of

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
# Anything that unpickles: pickle itself, its relatives, pyzmq's *_pyobj / *_serialized,
# and the multiprocessing channels that pickle what they carry.
_MODULES = r"(c?pickle|dill|cloudpickle|marshal|shelve|joblib)"
UNPICKLING = re.compile(
    rf"\bimport {_MODULES}\b|\bfrom {_MODULES} import|\bpickle\.|_pyobj\(|_serialized\(|"
    r"\b(mp|multiprocessing|ctx|get_context\([^)]*\))\.(Joinable|Simple)?(Queue|Pipe|Manager)\(|"
    r"multiprocessing\.connection|torch\.load\("
)


def test_no_socket_unpickles_anything():
    offenders = []
    for top in ("mpprefill", "ipc", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if UNPICKLING.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.fixture(scope="module")
def server():
    srv = Serve.start("--forward-mode", "proc-ahead", "--disaggregation-transfer-backend", "fake")
    yield srv
    srv.kill()


def test_ipc_dir_is_private_and_segments_are_0600(server):
    runtime = runtime_dir_of(server.worker_pid())
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    assert os.stat(runtime).st_uid == os.getuid()
    assert os.listdir(runtime)  # the worker channel's socket lives there
    segments = server.segments()
    assert segments
    for name in segments:
        assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600, name


def _listen_addresses(port: int) -> list[str]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":  # LISTEN
                    out.append(addr)
    return out


def test_tcp_binds_to_loopback_by_default(server):
    assert _listen_addresses(server.port) == ["0100007F"]  # 127.0.0.1, little-endian hex


def test_decode_binds_to_loopback_by_default():
    decode = Serve("--page-size", "16", "--max-total-tokens", "1024", command="decode")
    try:
        deadline = time.monotonic() + 60
        while not _listen_addresses(decode.port) and time.monotonic() < deadline:
            assert decode.proc.poll() is None, decode.output()
            time.sleep(0.2)
        assert _listen_addresses(decode.port) == ["0100007F"]
        segments = [s for s in os.listdir("/dev/shm") if s.startswith(f"mppdecode_{decode.pid}_")]
        assert segments and all(
            stat.S_IMODE(os.stat("/dev/shm/" + s).st_mode) == 0o600 for s in segments
        )
        assert decode.stop() == 0
    finally:
        if decode.proc.poll() is None:
            decode.proc.kill()
        decode.log.close()


def test_oversize_frame_gets_an_error_with_its_rid(server):
    sock = dealer(server.port)
    head = b'{"type": "generate", "rid": "big", "input_ids": ['
    frame = head + b"1," * (protocol.MAX_FRAME_BYTES // 2) + b"1]}"
    assert protocol.MAX_FRAME_BYTES < len(frame) <= protocol.MAX_WIRE_BYTES
    sock.send(frame)
    reply = recv_json(sock, 30)
    assert reply["rid"] == "big" and reply["status"] == "error"
    assert "exceeds" in reply["error"]
    sock.close(linger=0)


def test_frame_beyond_the_wire_limit_is_dropped_and_serving_goes_on(server):
    sock = dealer(server.port)
    sock.send(b" " * (protocol.MAX_WIRE_BYTES + 1))  # ZeroMQ drops it and the connection
    assert recv_json(sock, 1.0) is None
    sock.close(linger=0)
    client = server.client()
    client.generate("after", [1, 2, 3])
    assert client.recv(60)["status"] == "done"
    client.close()


def test_deep_nesting_and_multipart_get_errors_with_their_rid(server):
    sock = dealer(server.port)
    deep = b'{"rid": "deep", "type": "generate", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    sock.send(deep)
    reply = {"rid": "deep", "status": "error", "error": _error_of(deep), "code": 400}
    assert recv_json(sock, 10) == reply
    sock.send_multipart([json.dumps({"type": "stats", "rid": "mp"}).encode(), b"x"])
    reply = recv_json(sock, 10)
    assert reply["rid"] == "mp" and reply["status"] == "error"
    sock.close(linger=0)


def _error_of(frame: bytes) -> str:
    try:
        protocol.parse_frame(frame)
    except MessageError as e:
        assert e.rid == "deep"
        return str(e)
    raise AssertionError("deep nesting parsed")
