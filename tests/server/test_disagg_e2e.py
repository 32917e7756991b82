"""serve + decode + a router, as separate processes: KV arrives verified, faults clean up."""

from __future__ import annotations

import json
import random
import tempfile
import time

import pytest

import ipc
from mpprefill.bench.procs import start_decode, start_server
from mpprefill.bench.router import Router
from mpprefill.bench.workload import RequestSpec
from mpprefill.engine import PrefillEngine
from mpprefill.server.client import Client
from tests.mooncake_check import skip_without_mooncake

pytestmark = pytest.mark.timeout(300)
PAGE, CHUNK = 16, 40  # chunk boundaries fall mid-page


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 4096) for _ in range(rng.randrange(40, 90))] for _ in range(3)]
    return [
        rng.choice(systems) + [rng.randrange(1, 4096) for _ in range(rng.randrange(1, 45))]
        for _ in range(n)
    ]


def specs(ps: list[list[int]], tag: str = "r") -> list[RequestSpec]:
    return [RequestSpec(f"{tag}{i}", p, 0.0) for i, p in enumerate(ps)]


@pytest.fixture
def cluster():
    started, log_dir = [], tempfile.mkdtemp(prefix="mpp-e2e-")

    def start(backend: str = "shm", decode_flags=(), serve_flags=()):
        decode = start_decode(
            [
                "--page-size",
                str(PAGE),
                "--verify",
                "--disaggregation-transfer-backend",
                backend,
                *decode_flags,
            ],
            log_dir,
        )
        started.append(decode)
        server = start_server(
            [
                "--forward-mode",
                "proc-ahead",
                "--page-size",
                str(PAGE),
                "--chunked-prefill-size",
                str(CHUNK),
                "--check-invariants",
                "--worker-threads",  # NOTE: the test workers share the cores; see test_engine
                "1",
                "--disaggregation-transfer-backend",
                backend,
                "--decode-address",
                f"127.0.0.1:{decode.port}",
                *serve_flags,
            ],
            log_dir,
        )
        started.append(server)
        return server, decode

    yield start
    for child in reversed(started):
        child.stop()
    ipc.sweep_stale("mppdecode")  # what a SIGKILLed decode left; a new decode does the same
    for child in started:
        assert child.shm_left() == [], f"{child.name} left shared segments"


def drained_stats(port: int, timeout: float = 30.0) -> dict:
    client = Client(f"127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            if stats["invariants"].get("checked") or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)
    finally:
        client.close()


def offline_first_tokens(ps: list[list[int]]) -> list[int]:
    with PrefillEngine(forward_mode="normal", page_size=PAGE, chunked_prefill_size=CHUNK) as e:
        return [o.first_token for o in e.prefill(ps)]


@pytest.mark.parametrize("backend, layerwise", [("shm", True), ("mooncake", False)])
def test_kv_arrives_verified_and_tokens_match_offline(cluster, backend, layerwise):
    """Layer by layer (`--disaggregation-layerwise-send`) over shm, whole pages over
    Mooncake: the model's KV arrives either way (whole pages over shm: the scheduler's own
    tests, tests/disagg/test_scheduler_transfer.py, and the other runs here)."""
    if backend == "mooncake":
        skip_without_mooncake()
    ps = prompts(14)
    flags = ["--disaggregation-layerwise-send"] if layerwise else []
    server, decode = cluster(backend, serve_flags=flags)
    router = Router(server.port, decode.port)
    results = router.run(specs(ps), room_base=100, timeout=240)
    router.close()
    assert [r.status for r in results] == ["done"] * len(ps), [r.error for r in results]
    assert all(r.verified is True for r in results)  # decode recomputed the KV and compared
    assert [r.first_token for r in results] == offline_first_tokens(ps)
    assert sum(r.cached_tokens for r in results) > 0  # the shared prefixes were early-sent
    assert drained_stats(server.port)["invariants"] == {"checked": True, "ok": True}


def test_decode_killed_mid_run_fails_only_the_affected(cluster):
    server, decode = cluster("shm", serve_flags=["--max-running-requests", "2"])
    router = Router(server.port, decode.port)
    ps = [p * 4 for p in prompts(12, seed=3)]  # long enough that the run outlasts the kill
    for i, spec in enumerate(specs(ps)):
        router._send(spec, 500 + i, {spec.rid: _Sink()})
    rids = {f"r{i}" for i in range(len(ps))}
    first = _collect(router.prefill, rids, timeout=120, until_done=2)
    decode.proc.kill()  # some requests are done; the rest are queued or in transfer
    client_replies = {**first, **_collect(router.prefill, rids - first.keys(), timeout=120)}
    router.close()
    statuses = [r["status"] for r in client_replies.values()]
    assert len(client_replies) == len(ps)  # every request answered once
    assert "error" in statuses and "done" in statuses  # the killed room's fail, earlier ones done
    assert drained_stats(server.port)["invariants"] == {"checked": True, "ok": True}


def test_abort_mid_chunk_and_unregistered_room(cluster):
    """Layer-wise send on: aborts land while a chunk's layers are on their way."""
    flags = ["--bootstrap-timeout", "2", "--disaggregation-layerwise-send"]
    server, decode = cluster("shm", serve_flags=flags)
    client = Client(f"127.0.0.1:{server.port}")
    client.generate("ghost", [5] * 40, bootstrap_room=9999)  # decode never hears of it
    reply = client.recv(30)
    assert reply["rid"] == "ghost" and "bootstrap" in reply["error"]
    router = Router(server.port, decode.port)
    long = specs([[7 + i] * 900 for i in range(3)], tag="long")
    for i, spec in enumerate(long):
        router._send(spec, 700 + i, {spec.rid: _Sink()})
    time.sleep(0.3)
    for spec in long:
        router.prefill.send(json.dumps({"type": "abort", "rid": spec.rid}).encode())
    replies = _collect(router.prefill, {s.rid for s in long}, timeout=60)
    router.close()
    client.close()
    assert all(r["status"] in ("done", "error") for r in replies.values())
    assert drained_stats(server.port)["invariants"] == {"checked": True, "ok": True}


class _Sink:
    t_send = 0.0


def _collect(sock, rids: set[str], timeout: float, until_done: int = 0) -> dict[str, dict]:
    """Replies for `rids`; with until_done, stop once that many requests are done."""
    out, deadline = {}, time.monotonic() + timeout
    while not rids <= out.keys() and time.monotonic() < deadline:
        if until_done and sum(r["status"] == "done" for r in out.values()) >= until_done:
            break
        if sock.poll(200):
            reply = json.loads(sock.recv())
            if reply["rid"] in out and reply.get("error") == "unknown rid":
                continue  # the answer to an abort that came after the request finished
            assert reply["rid"] not in out, "a request got two replies"
            out[reply["rid"]] = reply
    return out
