"""KV transfer from a tensor-parallel prefill (CPU ranks over gloo) into a TP 1 decode: every
rank's pool ships its KV heads, the decode assembles all of them.

The decode is `mpprefill decode --model-path --verify` for the small GQA Llama: rooms a router
registers come back verified against the KV of one dense (TP 1) prefill of the prompt; rooms
of its own generate requests decode greedily on the KV that arrived.
"""

from __future__ import annotations

import random

import pytest

from ipc.codec import MessageError
from mpprefill import protocol
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, ModelConfig, load_model
from mpprefill.model.export import save_random_model
from mpprefill.modes import MODES
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.server.client import Client
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE, DecodeProc, Router, serving
from tests.disagg.swa_helpers import PATTERN, WINDOW
from tests.mooncake_check import skip_without_mooncake
from tests.reliability.helpers import Serve

pytestmark = pytest.mark.timeout(180)

# GQA: 4 query heads, 2 KV heads; at TP 4 each KV head is held by two ranks.
GQA = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    architecture="LlamaForCausalLM",
)
CHUNK = 40  # chunk ends fall mid-page
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(GQA, str(tmp_path_factory.mktemp("gqa")), seed=5)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def decode(model_dir):
    """A generating, verifying shm decode server at TP 1; it must leave no segment."""
    d = DecodeProc("--model-path", model_dir, "--verify").wait_ready(60)
    yield d
    left = d.close()
    assert not left, f"decode left segments behind: {left}\n{d.output()}"


def prompts(seed: int, n: int) -> list[list[int]]:
    """A shared system prompt (prefix hits send early) and tails past a chunk."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 512) for _ in range(37)]
    return [system + [rng.randrange(1, 512) for _ in range(rng.randrange(1, 50))] for _ in range(n)]


def run_prefill(
    model_dir: str | None, tp: int, backend: str, decode_address: str, reqs: list[Req], **extra
):
    """Prefill `reqs` on a TP `tp` group, sending through `backend`; what it shipped."""
    args = ServerArgs(
        model_path=model_dir,
        forward_mode="proc-ahead",
        tp_size=tp,
        page_size=PAGE,
        chunked_prefill_size=CHUNK,
        max_total_tokens=2048,
        disaggregation_transfer_backend=backend,
        decode_address=decode_address,
        worker_threads=1,
        **extra,
    )
    worker, config = make_worker(args, MODES["proc-ahead"])
    try:
        transfer = make_transfer(
            backend,
            worker.kv_shards(),
            PAGE,
            decode_address,
            fence=worker.kv_fence,
            layers=worker.layer_progress,  # None unless layer-wise send is on
        )
        try:
            s = Scheduler(args, config, worker, transfer)
            for r in reqs:
                s.add_request(r)
            LOOPS["proc-ahead"](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)
        finally:
            transfer.close()
    finally:
        worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert sum(r.cached_tokens for r in reqs) > 0  # cached prefixes were sent early
    return transfer.shipped


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of a dense TP 1 prefill of the whole sequence, one token at a time."""
    seq, out = list(ids), []
    for _ in range(n):
        kv = KVCache.for_model(model.config, (len(seq) // PAGE + 1) * PAGE)
        logits = model(ForwardBatch.build([seq], [0], [list(range(len(seq)))]), kv)
        out.append(int(logits[0].argmax()))
        seq.append(out[-1])
    return out


def registered(router: Router, tag: str, ps: list[list[int]], base: int) -> list[Req]:
    reqs = [Req(f"{tag}{i}", p, bootstrap_room=base + i) for i, p in enumerate(ps)]
    for r in reqs:
        router.register(r.rid, r.bootstrap_room, r.origin_input_ids)
    return reqs


def assert_verified(replies: dict, reqs: list[Req]) -> None:
    """The decode compared each room's KV to a dense TP 1 prefill of its prompt."""
    for r in reqs:
        reply = replies[r.rid]
        assert reply["status"] == "done" and reply["first_token"] == r.first_token, reply
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply


def test_tp2_prefill_into_tp1_decode(model_dir, model, decode):
    """Router rooms arrive verified; the decode server's own rooms generate the dense
    model's greedy tokens."""
    client = Client(f"127.0.0.1:{decode.zmq_port}")
    try:
        with Router(decode.address) as router:
            reqs = registered(router, "kv", prompts(1, 4), base=100)
            gen = prompts(2, 2)
            for i, p in enumerate(gen):
                params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
                client.send_raw(protocol.generate_frame(f"gen{i}", p, params, 200 + i))
            reqs += [Req(f"gen{i}", p, bootstrap_room=200 + i) for i, p in enumerate(gen)]
            shipped = run_prefill(model_dir, 2, "shm", decode.address, reqs)
            replies = router.recv_many(4)
        generated = client.recv_until({"gen0", "gen1"}, timeout=60)
    finally:
        client.close()
    assert (shipped.tp_size, shipped.kv_heads) == (2, [[0, 1], [1, 2]])
    assert_verified(replies, reqs[:4])
    for i, p in enumerate(gen):
        done = generated[f"gen{i}"]
        assert done["status"] == "done", done
        assert done["output_ids"] == greedy(model, p, NEW_TOKENS)
        assert done["output_ids"][0] == reqs[4 + i].first_token


def test_replicated_kv_heads_ship_once(model_dir, decode):
    """TP 4 over 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1; ranks 0 and 2 ship.
    Layer by layer: a layer goes once every rank's counter says it is written."""
    with Router(decode.address) as router:
        reqs = registered(router, "rep", prompts(3, 3), base=300)
        shipped = run_prefill(
            model_dir, 4, "shm", decode.address, reqs, disaggregation_layerwise_send=True
        )
        replies = router.recv_many(len(reqs))
    assert (shipped.tp_size, shipped.kv_heads) == (4, [[0, 1], [1, 2]])
    assert_verified(replies, reqs)
    assert all(r.sender.layerwise for r in reqs)


def test_serve_tp2_ships_over_shm(model_dir, decode):
    """`mpprefill serve --tp-size 2` with the shm backend: replies once the decode has the KV,
    verified; it stops cleanly, leaving no segment."""
    srv = Serve.start(
        *("--model-path", model_dir, "--tp-size", "2", "--forward-mode", "proc-ahead"),
        *("--disaggregation-transfer-backend", "shm", "--decode-address", decode.address),
        *("--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK)),
        *("--worker-threads", "1", "--log-level", "warning"),
    )
    client = srv.client()
    try:
        with Router(decode.address) as router:
            ps = prompts(5, 3)
            for i, p in enumerate(ps):
                router.register(f"s{i}", 600 + i, p)
                client.send_raw(protocol.generate_frame(f"s{i}", p, None, 600 + i))
            served = client.recv_until({f"s{i}" for i in range(len(ps))}, timeout=60)
            replies = router.recv_many(len(ps))
    finally:
        client.close()
        rc = srv.stop()
        left = srv.segments()
        srv.kill()
    for i in range(len(ps)):
        assert served[f"s{i}"]["status"] == "done", served[f"s{i}"]
        reply = replies[f"s{i}"]
        assert reply["first_token"] == served[f"s{i}"]["first_token"], reply
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
    assert rc == 0 and left == []


def test_tp2_sliding_window_model_sends_its_last_window(room):
    """The built-in model with sliding-window layers: each rank's SWA pool ships its heads
    of the last window only (the verifier checks the rest stayed unwritten)."""
    swa = dict(sliding_window=WINDOW, swa_layers=PATTERN)
    rx = DecodeReceiver(DecodeArgs(receiver_port=0, page_size=PAGE, verify=True, **swa))
    with serving(rx), Router(rx.address) as router:
        ps = [p * 2 for p in prompts(6, 3)]  # longer than the window
        reqs = registered(router, "swa", ps, base=room())
        router.sync()
        shipped = run_prefill(None, 2, "shm", rx.address, reqs, swa_full_tokens_ratio=0.2, **swa)
        replies = router.recv_many(len(reqs))
    assert shipped.shards[0].kv.swa_buffer is not None and shipped.tp_size == 2
    assert_verified(replies, reqs)


def test_tp2_prefill_into_mooncake_decode(model_dir):
    skip_without_mooncake()
    d = DecodeProc("--model-path", model_dir, "--verify", backend="mooncake").wait_ready(60)
    try:
        with Router(d.address) as router:
            reqs = registered(router, "mc", prompts(4, 3), base=400)
            shipped = run_prefill(model_dir, 2, "mooncake", d.address, reqs)
            replies = router.recv_many(len(reqs))
    finally:
        d.close()
    assert shipped.kv_heads == [[0, 1], [1, 2]]
    assert_verified(replies, reqs)


@pytest.mark.parametrize(
    "tp, kv_heads",
    [(2, [[0, 1]]), (2, [[0, 1], [0, 2]]), (2, [[0, 2], [2, 3]]), (1, [[0, 1], [1, 2]]), (2, [])],
)
def test_decode_refuses_heads_that_do_not_tile_its_pool(decode, room, tp, kv_heads):
    """A bootstrap whose pools miss, overlap or overrun the decode's 2 KV heads (or more
    pools than ranks) fails the room before any page is written; the router hears why."""
    room = room()
    with Router(decode.address) as router, Router(decode.address) as prefill:
        router.register("bad", room, [1, 2, 3])
        router.sync()
        prefill.send({"type": "bootstrap", "room": room, "tp_size": tp, "kv_heads": kv_heads})
        reply = prefill.recv()
        assert reply["type"] == "bootstrap_reply" and reply["status"] == "error", reply
        assert "does not fill" in reply["error"] or "named no KV head" in reply["error"]
        answer = router.recv()
        assert answer["rid"] == "bad" and answer["status"] == "error", answer


def test_bootstrap_carries_the_head_ranges():
    msg = wire.Bootstrap(7, 4, [[0, 1], [1, 2]])
    assert wire.decode(wire.encode(msg)) == msg
    assert wire.decode(b'{"type":"bootstrap","room":7}') == wire.Bootstrap(7, 1, [])
    for bad in ([[1, 1]], [[0]], [[0, -1]], "0-1"):
        with pytest.raises(MessageError, match="kv_heads"):
            wire.decode(wire.encode(wire.Bootstrap(7, 2, bad)))
    assert wire.head_tiling_error([[0, 2], [2, 4]], 4, 2) is None
    assert wire.head_tiling_error([[2, 4], [0, 2]], 4, 4) is None
    assert wire.head_tiling_error([], 4, 1) is None  # a TP 1 prefill of before: one pool


def test_shipped_pools_keep_one_per_head_range():
    def pool(heads: int) -> KVCache:
        return KVCache(2, 32, heads, 8)

    shards = [(pool(1), range(0, 1)), (pool(1), range(0, 1)), (pool(1), range(1, 2))]
    shipped = ShippedKV.of(shards + [(pool(1), range(1, 2))])
    assert [s.kv for s in shipped.shards] == [shards[0][0], shards[2][0]]
    assert shipped.layout(PAGE).num_kv_heads == 2
    whole = pool(3)
    assert ShippedKV.of(whole).kv_heads == [[0, 3]]
    with pytest.raises(ValueError, match="does not fill"):
        ShippedKV.of([(pool(1), range(0, 1)), (pool(1), range(2, 3))])
    with pytest.raises(ValueError, match="said to hold"):
        ShippedKV.of([(pool(2), range(0, 1)), (pool(1), range(1, 2))])
    with pytest.raises(ValueError, match="differ"):
        ShippedKV.of([(pool(1), range(0, 1)), (KVCache(2, 64, 1, 8), range(1, 2))])
