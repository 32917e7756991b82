"""KV in bfloat16 from prefill to decode over shm, and a decode whose pool dtype differs
refusing the room before any page is written, the error reaching both clients."""

from __future__ import annotations

import random

import pytest

from ipc.codec import MessageError
from mpprefill import protocol
from mpprefill.bench.procs import free_port
from mpprefill.config import ServerArgs
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_transfer
from mpprefill.memory.allocator import cdiv
from mpprefill.modes import MODES
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.server.client import Client
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE, DecodeProc, Router
from tests.reliability.helpers import Serve

pytestmark = pytest.mark.timeout(180)
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def bf16_decode():
    """A verifying shm decode server in bfloat16 (model and pool); it must leave no segment."""
    d = DecodeProc("--verify", "--dtype", "bfloat16").wait_ready(60)
    yield d
    left = d.close()
    assert not left, f"decode left segments behind: {left}\n{d.output()}"


def workload(seed: int, n: int = 6) -> list[list[int]]:
    """A shared system prompt (cached prefixes send early) and tails past a chunk."""
    rng = random.Random(seed)
    system = [rng.randrange(4096) for _ in range(40)]
    return [system + [rng.randrange(4096) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.usefixtures("no_prefill_segments")
@pytest.mark.parametrize("mode", ["overlap", "proc-ahead"])
def test_bfloat16_kv_arrives_verified(mode, bf16_decode):
    """The real loops send bfloat16 pages (cached prefixes early, chunks mid-page) into the
    decode's bfloat16 pool, which recomputes and checks every prompt's KV."""
    args = ServerArgs(
        forward_mode=mode,
        dtype="bfloat16",
        page_size=PAGE,
        chunked_prefill_size=32,
        max_total_tokens=2048,
        disaggregation_transfer_backend="shm",
        decode_address=bf16_decode.address,
        worker_threads=1,
    )
    worker, config = make_worker(args, MODES[mode])
    address = bf16_decode.address
    transfer = make_transfer("shm", worker.kv_cache, PAGE, address, fence=worker.kv_fence)
    try:
        assert transfer.layout.dtype == "bfloat16"
        s = Scheduler(args, config, worker, transfer)
        base = 20_000 + 100 * ["overlap", "proc-ahead"].index(mode)
        reqs = [Req(f"{mode}-{i}", p, bootstrap_room=base + i) for i, p in enumerate(workload(1))]
        with Router(address) as router:
            for r in reqs:
                router.register(r.rid, r.bootstrap_room, r.origin_input_ids)
            for r in reqs:
                s.add_request(r)
            LOOPS[mode](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)
            replies = router.recv_many(len(reqs))
    finally:
        transfer.close()
        worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert sum(r.cached_tokens for r in reqs) > 0  # early sends of cached prefixes happened
    for r in reqs:
        reply = replies[r.rid]
        assert reply["status"] == "done" and reply["first_token"] == r.first_token, reply
        # recomputed densely in bfloat16 at the decode: equal up to bfloat16 rounding
        assert reply["verified"] is True and reply["max_abs_err"] < 2e-2, reply
        assert r.sender.pages_sent == cdiv(r.prompt_len, PAGE)


def test_a_bootstrap_of_another_dtype_is_refused(bf16_decode):
    """Before any page is written: the prefill hears why, and so does the room's router."""
    with Router(bf16_decode.address) as router, Router(bf16_decode.address) as prefill:
        router.register("f32", 777, [1, 2, 3])
        router.sync()
        prefill.send({"type": "bootstrap", "room": 777, "dtype": "float32"})
        reply = prefill.recv()
        assert reply["type"] == "bootstrap_reply" and reply["status"] == "error", reply
        assert "'float32'" in reply["error"] and "bfloat16" in reply["error"], reply
        answer = router.recv()
        assert answer["rid"] == "f32" and answer["status"] == "error", answer
        assert "float32" in answer["error"] and "bfloat16" in answer["error"], answer


def test_the_bootstrap_names_the_pool_dtype():
    msg = wire.Bootstrap(7, 2, [[0, 1], [1, 2]], "bfloat16")
    assert wire.decode(wire.encode(msg)) == msg
    assert wire.decode(b'{"type":"bootstrap","room":7}').dtype == ""  # a prefill of before
    with pytest.raises(MessageError, match="dtype"):
        wire.decode(b'{"type":"bootstrap","room":7,"dtype":16}')
    assert wire.dtype_error("", "float32") is None
    assert wire.dtype_error("bfloat16", "bfloat16") is None
    why = wire.dtype_error("bfloat16", "float32")
    assert "'bfloat16'" in why and "float32" in why and "--kv-cache-dtype" in why


def test_a_decode_of_another_dtype_fails_both_clients():
    """A float32 prefill (its bootstrap endpoint) and a generating bfloat16 decode: the
    decode refuses the room at its bootstrap, its client gets an error naming both dtypes,
    and the prefill's client an error too."""
    port = free_port()
    prefill = Serve.start(
        *("--disaggregation-transfer-backend", "shm", "--forward-mode", "overlap"),
        *("--disaggregation-bootstrap-port", str(port), "--page-size", str(PAGE)),
        *("--worker-threads", "1", "--bootstrap-timeout", "30", "--log-level", "warning"),
    )
    decode = DecodeProc("--dtype", "bfloat16")
    p = d = None
    try:
        decode.wait_ready(60)
        p = prefill.client()
        d = Client(f"{HOST}:{decode.zmq_port}")
        ids = [(5 * i) % 4000 + 1 for i in range(40)]
        params = {"temperature": 0.0, "max_new_tokens": 4}
        d.send_raw(protocol.generate_frame("mix", ids, params, 9, HOST, port))
        p.send_raw(protocol.generate_frame("mix", ids, {"temperature": 0.0}, 9))
        at_decode, at_prefill = d.recv(60), p.recv(60)
    finally:
        for c in (p, d):
            if c is not None:
                c.close()
        left = decode.close()
        prefill.kill()
    assert not left
    for reply in (at_decode, at_prefill):
        assert reply["rid"] == "mix" and reply["status"] == "error", reply
    assert "'float32'" in at_decode["error"] and "bfloat16" in at_decode["error"], at_decode
    # NOTE: the decode also withdraws the failed room at the prefill's endpoint, another
    # socket; where that lands first, the prefill's request fails as withdrawn instead.
    why = at_prefill["error"]
    assert ("float32" in why and "bfloat16" in why) or "withdrew" in why, at_prefill
