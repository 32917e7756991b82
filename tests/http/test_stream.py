"""The front before a server that generates several tokens and streams them (as a decode
server does): what each generate frame carries, server-sent events built from partial
replies, and output taken from the done reply. The server here is a ROUTER in this
process that speaks the request protocol."""

from __future__ import annotations

import json
import threading

import pytest
import zmq

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mpprefill import protocol  # noqa: E402
from mpprefill.bench.procs import free_port  # noqa: E402
from tests.http.helpers import Front, sse_events  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STOP = {"type": "stop", "matched": 2}


class ScriptedServer:
    """Answers stats, and each generate with tokens last+1, last+2, last+3: in two partial
    replies then a done reply when streamed, in the done reply alone otherwise."""

    def __init__(self):
        self.port = free_port()
        self.frames: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{self.port}")
        try:
            while not self._stop.is_set():
                if sock.poll(50):
                    ident, frame = sock.recv_multipart()
                    for reply in self._answer(json.loads(frame)):
                        sock.send_multipart([ident, reply])
        finally:
            sock.close(linger=0)
            ctx.term()

    def _answer(self, msg: dict) -> list[bytes]:
        if msg["type"] == "stats":
            return [json.dumps({"rid": msg["rid"], "status": "stats"}).encode()]
        if msg["type"] != "generate":
            return []
        self.frames.append(msg)
        rid, ids = msg["rid"], msg["input_ids"]
        out = [ids[-1] + k for k in (1, 2, 3)]
        done = protocol.done_reply(rid, out[0], len(ids), 0, out, STOP)
        if not msg.get("stream"):
            return [done]
        return [protocol.partial_reply(rid, out[:1]), protocol.partial_reply(rid, out[1:]), done]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    front = Front.start(server.port)
    yield server, front
    front.kill()
    server.close()


def _stream(front: Front, body: dict) -> list:
    status, headers, data = front.request("POST", "/generate", json.dumps(body).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    return sse_events(data)


def test_the_frame_carries_what_the_decode_side_needs(scripted):
    server, front = scripted
    sampling = {"temperature": 0, "max_new_tokens": 16, "stop_token_ids": [2], "ignore_eos": True}
    body = {"input_ids": [5, 6], "rid": "f1", "sampling_params": sampling, "stream": True}
    body |= {"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 42}
    _stream(front, body)
    frame = next(f for f in server.frames if f["rid"] == "f1")
    assert frame["stream"] is True
    assert (frame["bootstrap_host"], frame["bootstrap_port"], frame["bootstrap_room"]) == (
        "10.0.0.2",
        8998,
        42,
    )
    sp = frame["sampling_params"]
    assert (sp["max_new_tokens"], sp["stop_token_ids"], sp["ignore_eos"]) == (16, [2], True)


def test_stream_events_carry_the_output_so_far_then_the_done_body(scripted):
    _, front = scripted
    events = _stream(front, {"input_ids": [5, 6], "rid": "s1", "stream": True})
    assert events[-1] == "[DONE]" and len(events) == 4, events
    assert [e["output_ids"] for e in events[:3]] == [[7], [7, 8, 9], [7, 8, 9]]
    assert [e["meta_info"]["finish_reason"] for e in events[:3]] == [None, None, STOP]
    assert events[1]["meta_info"]["completion_tokens"] == 3
    assert events[2]["meta_info"]["prompt_tokens"] == 2 and "e2e_latency" in events[2]["meta_info"]


def test_a_streamed_output_stops_at_max_new_tokens(scripted):
    _, front = scripted
    body = {"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    events = _stream(front, body)
    assert [e["output_ids"] for e in events[:-1]] == [[7], [7, 8], [7, 8]]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_a_batch_stream_indexes_every_event(scripted):
    _, front = scripted
    events = _stream(front, {"input_ids": [[1, 2], [3, 40]], "stream": True})
    assert events[-1] == "[DONE]" and len(events) == 7
    by_index = {0: [], 1: []}
    for e in events[:-1]:
        by_index[e["index"]].append(e["output_ids"])
    assert by_index == {0: [[3], [3, 4, 5], [3, 4, 5]], 1: [[41], [41, 42, 43], [41, 42, 43]]}


def test_without_stream_the_output_is_the_done_replys(scripted):
    server, front = scripted
    status, out = front.post("/generate", {"input_ids": [5, 6], "rid": "n1"})
    assert status == 200, out
    assert out["output_ids"] == [7, 8, 9] and out["meta_info"]["finish_reason"] == STOP
    assert out["meta_info"]["completion_tokens"] == 3
    assert "stream" not in next(f for f in server.frames if f["rid"] == "n1")
