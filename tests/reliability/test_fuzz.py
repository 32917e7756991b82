"""Hypothesis over the request protocol, against one serve process for the whole module.

Arbitrary JSON values and bytes never stop the server, and every frame whose rid can be
read gets a reply carrying that rid.
"""

from __future__ import annotations

import itertools
import json
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.helpers import Serve, dealer, recv_json

pytestmark = pytest.mark.timeout(240)
_ids = itertools.count()

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
token = st.integers(min_value=-5, max_value=5000) | json_value
request = st.fixed_dictionaries(
    {"type": st.sampled_from(["generate", "abort", "stats", "launch"]) | json_value},
    optional={
        "rid": st.text(min_size=0, max_size=30) | json_value,
        "input_ids": st.lists(token, max_size=12) | json_value,
        "sampling_params": st.fixed_dictionaries(
            {},
            optional={
                k: json_value | st.floats(0, 2) for k in ("temperature", "top_p", "top_k", "seed")
            },
        )
        | json_value,
        "bootstrap_room": st.integers(min_value=-1, max_value=2**70) | json_value,
        "extra": json_value,
    },
)


@pytest.fixture(scope="module")
def server():
    srv = Serve.start(
        *("--forward-mode", "proc-ahead", "--disaggregation-transfer-backend", "fake"),
        *("--max-total-tokens", "4096", "--log-level", "warning"),
    )
    sock = dealer(srv.port)
    yield srv, sock
    sock.close(linger=0)
    assert srv.proc.poll() is None, f"the server died:\n{srv.output()}"
    assert srv.stop(signal.SIGTERM) == 0
    assert srv.segments() == []
    srv.kill()


def roundtrip(server, frames: list[bytes], readable_rid: str | None) -> list[dict]:
    """Send `frames`, then a stats probe; the replies until the probe's, plus the awaited rid."""
    srv, sock = server
    probe = f"probe-{next(_ids)}"
    sock.send_multipart(frames)
    sock.send(json.dumps({"type": "stats", "rid": probe}).encode())
    replies, seen_probe = [], False
    while not seen_probe or (
        readable_rid and not any(r.get("rid") == readable_rid for r in replies)
    ):
        reply = recv_json(sock, 60)
        assert reply is not None, f"no reply; server alive: {srv.proc.poll() is None}"
        seen_probe = seen_probe or reply.get("rid") == probe
        replies.append(reply)
    return [r for r in replies if r.get("rid") != probe]


def _unique_rid(obj):
    """Our own rid when the frame has a string rid, so replies can be told apart."""
    if isinstance(obj, dict) and isinstance(obj.get("rid"), str):
        obj["rid"] = f"fz{next(_ids)}:{obj['rid']}"
        return obj["rid"]
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(request)
def test_any_json_request_is_answered(server, obj):
    rid = _unique_rid(obj)
    replies = roundtrip(server, [json.dumps(obj).encode()], rid)
    assert replies, "every frame gets a reply"
    if rid is not None:
        assert [r for r in replies if r.get("rid") == rid]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(json_value)
def test_any_json_value_is_answered(server, value):
    assert roundtrip(server, [json.dumps(value).encode()], None)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_any_bytes_are_answered(server, data):
    replies = roundtrip(server, [data], None)
    assert replies and all(r["status"] in ("error", "stats", "done") for r in replies)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=20), st.binary(max_size=60))
def test_broken_json_with_a_readable_head_gets_its_rid(server, rid, tail):
    """The rid is read from the frame's head when the rest is not JSON."""
    rid = f"head{next(_ids)}:{rid}"
    frame = b'{"rid": ' + json.dumps(rid).encode() + b", " + tail
    replies = roundtrip(server, [frame], None)
    assert any(r.get("rid") == rid for r in replies) or _parses(frame)


def _parses(frame: bytes) -> bool:
    try:
        json.loads(frame)
    except ValueError:
        return False
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=40), min_size=2, max_size=4))
def test_multipart_messages_get_an_error(server, frames):
    replies = roundtrip(server, frames, None)
    assert [r["status"] for r in replies] == ["error"]


def test_the_server_still_serves_real_requests(server):
    srv, sock = server
    sock.send(json.dumps({"type": "generate", "rid": "real", "input_ids": [1, 2, 3]}).encode())
    reply = recv_json(sock, 60)
    while reply is not None and reply.get("rid") != "real":
        reply = recv_json(sock, 60)
    assert reply is not None and reply["status"] == "done"
