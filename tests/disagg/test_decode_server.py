"""One prefill, two decode servers, driven as SGLang's router drives them: the same room to a
decode (with the prefill's bootstrap_host/port) and to the prefill. The decodes register
their rooms at the prefill's bootstrap endpoint, receive the KV and generate."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch
import zmq

from mpprefill import protocol
from mpprefill.bench.procs import children, free_port
from mpprefill.disagg import wire
from mpprefill.http.errors import status_of
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from mpprefill.server.client import Client
from tests.disagg.helpers import PAGE, DecodeProc
from tests.reliability.helpers import Serve, pid_gone

pytestmark = pytest.mark.timeout(240)
HOST = "127.0.0.1"
WAITING_TIMEOUT_B = 15.0  # decode B's --waiting-timeout


@pytest.fixture(scope="module")
def model():
    return load_model(None)  # the servers' built-in model, seed 0


def reference(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of a dense prefill of the whole sequence, one token at a time."""
    seq, out = list(ids), []
    for _ in range(n):
        kv = KVCache.for_model(model.config, (len(seq) // PAGE + 1) * PAGE)
        logits = model(ForwardBatch.build([seq], [0], [list(range(len(seq)))]), kv)
        out.append(int(logits[0].argmax()))
        seq.append(out[-1])
    return out


class Cluster:
    def __init__(self):
        self.bootstrap_port = free_port()
        self.prefill = Serve.start(
            *("--disaggregation-transfer-backend", "shm", "--forward-mode", "overlap"),
            *("--disaggregation-bootstrap-port", str(self.bootstrap_port)),
            *("--page-size", str(PAGE), "--worker-threads", "1", "--bootstrap-timeout", "30"),
            *("--log-level", "warning"),
        )
        self.decodes = [
            DecodeProc().wait_ready(60),
            DecodeProc("--waiting-timeout", str(WAITING_TIMEOUT_B)).wait_ready(60),
        ]
        self.p = self.prefill.client()
        self.d = [Client(f"{HOST}:{d.zmq_port}") for d in self.decodes]
        for c in self.d:
            assert c.stats(timeout=30)["role"] == "decode"
        # a room the prefill never hears of, sent first so that its wait overlaps the tests
        self.orphan = Client(f"{HOST}:{self.decodes[1].zmq_port}")
        self.orphan.send_raw(self.decode_frame("orphan", prompt(3), 400, max_new_tokens=4))

    def decode_frame(self, rid, ids, room, stream=False, **sampling) -> bytes:
        params = {"temperature": 0.0, **sampling}
        return protocol.generate_frame(rid, ids, params, room, HOST, self.bootstrap_port, stream)

    def prefill_generate(self, rid: str, ids: list[int], room: int, **sampling) -> None:
        params = {"temperature": 0.0, **sampling}
        self.p.send_raw(protocol.generate_frame(rid, ids, params, room))

    def close(self) -> list[str]:
        for c in (self.p, *self.d, self.orphan):
            c.close()
        left = [s for d in self.decodes for s in d.close()]
        self.prefill.kill()
        return left


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    assert c.close() == []


def replies_until_done(client: Client, rids: set[str], timeout: float = 120.0):
    """{rid: (partial replies, final reply)} once each rid has its final reply."""
    partials: dict[str, list[dict]] = {r: [] for r in rids}
    final: dict[str, dict] = {}
    while set(final) != rids:
        reply = client.recv(timeout)
        assert reply["rid"] in rids, reply
        if reply["status"] == "partial":
            partials[reply["rid"]].append(reply)
        else:
            final[reply["rid"]] = reply
    return {r: (partials[r], final[r]) for r in rids}


def prompt(n: int) -> list[int]:
    return [(7 * n + 13 * i) % 4000 + 1 for i in range(5 + 9 * n)]


def test_greedy_generation_equals_a_dense_reference(cluster, model):
    """max_new_tokens 1..16, alternating decodes; half the decodes hear of their room before
    the prefill does, half after (the prefill's sender waits for the registration)."""
    rids = {0: set(), 1: set()}
    for n in range(1, 17):
        rid, room, which = f"g{n}", 100 + n, n % 2
        frame = cluster.decode_frame(rid, prompt(n), room, max_new_tokens=n)
        if n % 4 < 2:
            cluster.d[which].send_raw(frame)
            cluster.prefill_generate(rid, prompt(n), room)
        else:
            cluster.prefill_generate(rid, prompt(n), room)
            cluster.d[which].send_raw(frame)
        rids[which].add(rid)
    prefill = cluster.p.recv_until({f"g{n}" for n in range(1, 17)}, timeout=120)
    decoded = {
        **replies_until_done(cluster.d[0], rids[0]),
        **replies_until_done(cluster.d[1], rids[1]),
    }
    for n in range(1, 17):
        rid = f"g{n}"
        partials, done = decoded[rid]
        assert prefill[rid]["status"] == "done", prefill[rid]
        assert done["status"] == "done", done
        assert not partials  # not streamed
        assert done["output_ids"] == reference(model, prompt(n), n), rid
        assert done["first_token"] == prefill[rid]["first_token"] == done["output_ids"][0]
        assert done["finish_reason"] == {"type": "length", "length": n}
        assert done["prompt_tokens"] == len(prompt(n))
        assert done["completion_tokens"] == n


def test_streamed_replies_add_up_to_the_output(cluster, model):
    rids = []
    for k, n in enumerate((1, 2, 9)):
        rid, room = f"s{n}", 300 + k
        frame = cluster.decode_frame(rid, prompt(n), room, True, max_new_tokens=n)
        cluster.d[k % 2].send_raw(frame)
        cluster.prefill_generate(rid, prompt(n), room)
        rids.append((rid, n, k % 2))
    cluster.p.recv_until({r for r, _, _ in rids}, timeout=120)
    for rid, n, which in rids:
        partials, done = replies_until_done(cluster.d[which], {rid})[rid]
        assert done["status"] == "done" and done["output_ids"] == reference(model, prompt(n), n)
        streamed = [t for p in partials for t in p["output_ids"]]
        # every token but the last comes in a partial; the done reply repeats them all
        assert streamed == done["output_ids"][:-1], (partials, done)


def penalised_reference(model, ids: list[int], n: int, penalty: float):
    """Greedy tokens under a repetition penalty (by hand, over the prompt and the output so
    far) of dense prefills, and each token's log_softmax over the penalised logits."""
    seq, out, logprobs = list(ids), [], []
    for _ in range(n):
        kv = KVCache.for_model(model.config, (len(seq) // PAGE + 1) * PAGE)
        logits = model(ForwardBatch.build([seq], [0], [list(range(len(seq)))]), kv)[0].clone()
        seen = torch.tensor(sorted(set(seq)))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
        logp = torch.log_softmax(logits, dim=-1)
        out.append(int(logp.argmax()))
        logprobs.append(logp)
        seq.append(out[-1])
    return out, logprobs


def test_logprobs_of_every_output_token_reach_the_decodes_replies(cluster, model):
    """return_logprob + top_logprobs_num + repetition_penalty on both sides: the prefill's
    done reply has its first token's logprob, the decode's (streamed here) every token's,
    the first equal to the prefill's."""
    n, penalty = 6, 1.5
    ids = next(
        prompt(k)
        for k in range(3, 12)
        if penalised_reference(model, prompt(k), n, penalty)[0] != reference(model, prompt(k), n)
    )
    tokens, ref = penalised_reference(model, ids, n, penalty)
    sampling = dict(repetition_penalty=penalty, return_logprob=True, top_logprobs_num=3)
    cluster.d[0].send_raw(cluster.decode_frame("lp", ids, 900, True, max_new_tokens=n, **sampling))
    cluster.prefill_generate("lp", ids, 900, **sampling)
    prefill = cluster.p.recv_until({"lp"}, timeout=120)["lp"]
    partials, done = replies_until_done(cluster.d[0], {"lp"})["lp"]
    assert done["status"] == "done" and done["output_ids"] == tokens
    assert prefill["first_token"] == tokens[0]
    assert prefill["output_token_logprobs"] == done["output_token_logprobs"][:1]
    assert prefill["output_top_logprobs"] == done["output_top_logprobs"][:1]
    assert len(done["output_token_logprobs"]) == len(done["output_top_logprobs"]) == n
    for k, token in enumerate(tokens):
        assert done["output_token_logprobs"][k] == pytest.approx(float(ref[k][token]), abs=1e-4)
        top_v, top_i = torch.topk(ref[k], 3)
        assert [t for t, _ in done["output_top_logprobs"][k]] == top_i.tolist()
        assert [v for _, v in done["output_top_logprobs"][k]] == pytest.approx(
            top_v.tolist(), abs=1e-4
        )
    streamed = [lp for p in partials for lp in p["output_token_logprobs"]]
    assert streamed == done["output_token_logprobs"][:-1]


def test_a_request_the_prefill_refuses_fails_on_the_decode_at_once(cluster):
    """The prefill refuses a request (here a duplicate rid) before it gets a sender: the
    decode that registered its room is told through the bootstrap endpoint, instead of
    waiting out its --waiting-timeout (600 s on decode A)."""
    c = cluster.d[0]
    c.send_raw(cluster.decode_frame("kept", prompt(2), 600, max_new_tokens=2))
    c.send_raw(cluster.decode_frame("refused", prompt(3), 601, max_new_tokens=2))
    cluster.prefill_generate("dup", prompt(2), 600)
    cluster.prefill_generate("dup", prompt(3), 601)  # refused: its rid is live
    replies = {}
    while len(replies) < 2:
        reply = c.recv(60)
        replies[reply["rid"]] = reply
    refused = replies["refused"]
    assert refused["status"] == "error", refused
    assert "refused the request: duplicate rid" in refused["error"], refused
    assert refused["code"] == protocol.Code.BAD_REQUEST  # the prefill's status for it
    assert replies["kept"]["status"] == "done" and len(replies["kept"]["output_ids"]) == 2
    prefill = sorted(cluster.p.recv(60)["status"] for _ in range(2))
    assert prefill == ["done", "error"]  # the first request, and the refusal


def test_a_room_refused_as_overloaded_fails_with_the_prefills_status(cluster):
    """A stand-in for the prefill's endpoint refuses the room as the prefill refuses an
    overloaded request: the decode's error reply carries 429, which its HTTP front answers
    with, not 500."""
    endpoint = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint.setsockopt(zmq.LINGER, 0)
    port = endpoint.bind_to_random_port(f"tcp://{HOST}")
    c = cluster.d[0]
    try:
        params = {"temperature": 0.0, "max_new_tokens": 2}
        c.send_raw(protocol.generate_frame("busy", prompt(2), params, 610, HOST, port))
        assert endpoint.poll(30_000)
        ident, frame = endpoint.recv_multipart()
        registration = wire.decode(frame)
        assert isinstance(registration, wire.RegisterRoom) and registration.room == 610
        why = "the prefill refused the request: overloaded"
        endpoint.send_multipart([ident, wire.encode(wire.RoomReply(610, False, why, 429))])
        reply = c.recv(30)
    finally:
        endpoint.close()
    assert reply["rid"] == "busy" and reply["status"] == "error", reply
    assert reply["code"] == protocol.Code.OVERLOADED and why in reply["error"], reply
    assert status_of(reply["error"], reply["code"]) == 429
    assert c.stats()["requests"] == 0


def test_decode_requests_are_checked_and_aborted(cluster):
    c = cluster.d[0]
    bad = [
        (protocol.generate_frame("nr", [1, 2], {"temperature": 0}), "bootstrap_room"),
        (cluster.decode_frame("voc", [1, 1 << 20], 401), "vocabulary"),
        (protocol.generate_frame("hp", [1], None, 402, HOST), "go together"),
        (cluster.decode_frame("long", [1] * 8000, 403, max_new_tokens=500), "context length"),
    ]
    for frame, why in bad:
        c.send_raw(frame)
        reply = c.recv(30)
        assert reply["status"] == "error" and why in reply["error"], reply
        assert reply["code"] == protocol.Code.BAD_REQUEST, reply
    c.send_raw(cluster.decode_frame("waits", prompt(2), 404, max_new_tokens=3))
    c.send_raw(cluster.decode_frame("waits", prompt(2), 405, max_new_tokens=3))
    assert c.recv(30) == {
        "rid": "waits",
        "status": "error",
        "error": "duplicate rid while the first is live",
        "code": protocol.Code.BAD_REQUEST,
    }
    other = Client(f"{HOST}:{cluster.decodes[0].zmq_port}")
    other.abort("waits")  # only its sender may abort it
    assert other.recv(30)["error"] == "unknown rid"
    other.close()
    c.abort("waits")
    assert c.recv(30) == {"rid": "waits", "status": "error", "error": "aborted by client"}
    stats = c.stats()
    assert stats["requests"] == 0 and stats["rooms"] == 0 and stats["pending"] == 0


def test_hostile_registrations_are_refused_and_the_prefill_keeps_serving(cluster, model):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{cluster.bootstrap_port}")

    def ask(obj) -> dict:
        sock.send(obj if isinstance(obj, bytes) else json.dumps(obj).encode())
        assert sock.poll(30_000)
        return json.loads(sock.recv())

    try:
        assert ask(b"\xff garbage")["type"] == "error"
        assert ask({"type": "register_room", "room": -1, "address": "h:1"})["type"] == "error"
        assert ask({"type": "register_room", "room": 500, "address": "h:0"})["ok"] is False
        # a hostile peer holds room 501 first: the decode's registration is refused, and
        # the prefill's KV goes to the hostile address, where nothing answers
        assert ask({"type": "register_room", "room": 501, "address": f"{HOST}:1"})["ok"]
        cluster.d[0].send_raw(cluster.decode_frame("stolen", prompt(4), 501, max_new_tokens=2))
        reply = cluster.d[0].recv(60)
        assert reply["status"] == "error" and "bootstrap refused" in reply["error"], reply
        assert "another decode" in reply["error"]
        cluster.prefill_generate("stolen", prompt(4), 501)
        failed = cluster.p.recv(60)
        assert failed["rid"] == "stolen" and failed["status"] == "error", failed
    finally:
        sock.close()
    # the prefill and the decode still serve
    cluster.d[0].send_raw(cluster.decode_frame("after", prompt(5), 502, max_new_tokens=5))
    cluster.prefill_generate("after", prompt(5), 502)
    assert cluster.p.recv(120)["status"] == "done"
    done = cluster.d[0].recv(120)
    assert done["output_ids"] == reference(model, prompt(5), 5)


def test_a_room_the_prefill_never_gets_times_out_on_the_decode(cluster):
    """The orphan was sent when the cluster started; its waiting timeout ran meanwhile."""
    reply = cluster.orphan.recv(WAITING_TIMEOUT_B + 60)
    assert reply == {
        "rid": "orphan",
        "status": "error",
        "error": f"no KV within {WAITING_TIMEOUT_B:.1f} s",
    }


def test_the_http_front_generates_and_dies_with_its_decode(model):
    """`mpprefill decode --port P`: the front is a child of the decode, answers /health and
    /generate, and the kernel ends it when the decode is killed at once."""
    pytest.importorskip("fastapi")
    from tests.http.helpers import Front

    bootstrap_port = free_port()
    prefill = Serve.start(
        *("--disaggregation-transfer-backend", "shm", "--forward-mode", "normal"),
        *("--disaggregation-bootstrap-port", str(bootstrap_port), "--page-size", str(PAGE)),
        *("--worker-threads", "1", "--log-level", "warning"),
    )
    decode = DecodeProc(http_port=free_port()).wait_ready(60)
    front = Front.__new__(Front)  # the decode's own front, not one this test starts
    front.port = decode.http_port
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    client = prefill.client()
    try:
        front_pid = _wait_healthy(front, decode)
        # what the decode does for a request that names this prefill, by hand: the front
        # sends bootstrap_room only
        sock.connect(f"tcp://{HOST}:{bootstrap_port}")
        register = {"type": "register_room", "room": 600, "address": f"{HOST}:{decode.port}"}
        sock.send(json.dumps(register).encode())
        assert sock.poll(30_000) and json.loads(sock.recv())["ok"] is True
        client.send_raw(protocol.generate_frame("h", prompt(6), {"temperature": 0.0}, 600))
        body = {
            "input_ids": prompt(6),
            "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            "bootstrap_room": 600,
        }
        status, reply = front.post("/generate", body, timeout=120)
        assert status == 200, reply
        # NOTE: a front that reads only a done reply's first_token (not its output_ids)
        # shows the first of the six tokens
        out = reply["output_ids"]
        assert len(out) in (1, 6) and out == reference(model, prompt(6), 6)[: len(out)]
        assert client.recv(60)["status"] == "done"
        decode.stop(signal.SIGKILL)
        assert pid_gone(front_pid, timeout=15), "the front outlived its decode"
    finally:
        sock.close()
        client.close()
        decode.close()
        prefill.kill()


def _wait_healthy(front, decode: DecodeProc, timeout: float = 90.0) -> int:
    """The front's pid once its /health answers 200 (the decode answered its stats)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if front.request("GET", "/health", timeout=5)[0] == 200:
                (pid,) = children(decode.proc.pid)
                return pid
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the decode's front is not healthy:\n{decode.output()}")
