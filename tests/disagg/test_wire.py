"""The disagg wire codec: round trips, validation, and what an error keeps of a bad frame;
the backend factories and the decode flags."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from ipc.codec import MessageError
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.command import add_decode_args
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_decode_pool, make_transfer
from mpprefill.disagg.sender import FakeTransfer
from mpprefill.flags import from_namespace

LAYOUT = wire.PoolLayout("float32", 4, 64, 2, 32, 16)

MESSAGES = [
    wire.Register("r1", 7, [1, 2, 3]),
    wire.RouterReply("r1", "done", 42, True, 1e-6),
    wire.RouterReply("r1", "done", 42),
    wire.RouterReply("r1", "error", error="aborted"),
    wire.Bootstrap(7),
    wire.BootstrapReply(7, "unknown"),
    wire.BootstrapReply(7, "ready", {"kind": "shm", "layout": LAYOUT.to_dict()}, [3, 4], 0),
    wire.TransferDone(7, 42, 2),
    wire.TransferDone(7, 42, 2, "run", -0.25, [[42, -0.25], [3, -1.5]]),
    wire.TransferDone(7, 42, 2, "run", -0.25, []),
    wire.Ack(7, False, "2 pages arrived, 3 expected"),
    wire.Abort(7),
    wire.Ping(),
    wire.Pong(),
    wire.ErrorReply("bad", 7),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = wire.encode(msg)
    assert wire.decode(frame) == msg
    obj = json.loads(frame)
    assert ("type" in obj) != isinstance(msg, wire.RouterReply)


def test_router_reply_shapes():
    """A field at its default (null) is left out; the reader takes a missing one as null."""
    done = json.loads(wire.encode(wire.RouterReply("a", "done", 5, None, None)))
    assert done == {"rid": "a", "status": "done", "first_token": 5}
    done = json.loads(wire.encode(wire.RouterReply("a", "done", 5, False, 0.5)))
    assert done == {"rid": "a", "status": "done", "first_token": 5, "verified": False,
                    "max_abs_err": 0.5}  # fmt: skip
    assert json.loads(wire.encode(wire.RouterReply("a", "error", error="x"))) == {
        "rid": "a", "status": "error", "error": "x"}  # fmt: skip


def test_a_frame_carries_every_field():
    assert json.loads(wire.encode(wire.Ack(7, True))) == {
        "type": "ack", "room": 7, "ok": True, "error": None, "instance": ""}  # fmt: skip
    assert json.loads(wire.encode(wire.Ping())) == {"type": "ping"}


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"type": "abort", "room": 1, "extra": 2}, "extra"),
        ({"type": "abort", "room": 2**63}, "room"),
        ({"type": "ack", "room": 1, "ok": True, "instance": "i" * (wire.MAX_STR + 1)}, "instance"),
        ({"type": "bootstrap", "room": 1, "tp_size": 0}, "tp_size"),
        ({"type": "bootstrap", "room": 1, "kv_heads": [[0, 2, 4]]}, "kv_heads"),
        ({"type": "bootstrap", "room": 1, "kv_heads": [[2, 2]]}, "kv_heads"),
        ({"type": "register_room", "room": 1, "address": "h:0"}, "address"),
        ({"type": "room_reply", "room": 1, "ok": False, "code": -1}, "code"),
        ({"rid": "r", "status": "maybe"}, "status"),
    ],
)
def test_an_error_names_the_offending_field(obj, field):
    with pytest.raises(MessageError, match=field) as e:
        wire.decode(json.dumps(obj).encode())
    assert e.value.room == obj.get("room")


@pytest.mark.parametrize(
    "obj, rid, room",
    [
        ({"type": "register", "rid": "a", "bootstrap_room": 1, "input_ids": []}, "a", 1),
        ({"type": "register", "rid": "a", "bootstrap_room": 1, "input_ids": [1, -2]}, "a", 1),
        ({"type": "register", "rid": "a", "bootstrap_room": True, "input_ids": [1]}, "a", None),
        ({"type": "register", "rid": 3, "bootstrap_room": 2}, None, 2),
        ({"type": "transfer_done", "room": 4, "first_token": 1}, None, 4),
        ({"type": "ack", "room": 4, "ok": 1}, None, 4),
        ({"type": "bootstrap_reply", "room": 4, "status": "maybe"}, None, 4),
        ({"type": "nope", "room": 9}, None, 9),
        ({"rid": "z"}, "z", None),
    ],
)
def test_invalid_messages_keep_readable_ids(obj, rid, room):
    with pytest.raises(MessageError) as e:
        wire.decode(json.dumps(obj).encode())
    assert (e.value.rid, e.value.room) == (rid, room)


@pytest.mark.parametrize("frame", [b"", b"\xff\xfe", b"nope", b"[]", b"3", b'"s"'])
def test_non_objects_are_refused(frame):
    with pytest.raises(MessageError):
        wire.decode(frame)


@pytest.mark.parametrize(
    "extra",
    [
        {"logprob": "x"},
        {"logprob": True},
        {"top_logprobs": [[1]]},
        {"top_logprobs": [[1, "x"]]},
        {"top_logprobs": [[-1, 0.5]]},
        {"top_logprobs": {"1": 0.5}},
        {"top_logprobs": [[i, -1.0] for i in range(21)]},
    ],
)
def test_transfer_done_logprobs_are_checked(extra):
    """The first token's logprob travels in transfer_done; a frame without it (a prefill
    of before, or a request that asked none) still decodes."""
    frame = {"type": "transfer_done", "room": 4, "first_token": 1, "num_pages": 2}
    assert wire.decode(json.dumps(frame).encode()) == wire.TransferDone(4, 1, 2)
    with pytest.raises(MessageError) as e:
        wire.decode(json.dumps({**frame, **extra}).encode())
    assert e.value.room == 4


def test_pool_layout():
    assert wire.PoolLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    assert LAYOUT.num_pages == 4
    assert LAYOUT.mismatch(wire.PoolLayout("float32", 4, 999, 2, 32, 16)) is None
    assert "page_size" in LAYOUT.mismatch(wire.PoolLayout("float32", 4, 64, 2, 32, 8))
    assert wire.PoolLayout.of(torch.zeros(2, 4, 64, 2, 32), 16) == LAYOUT
    with pytest.raises(MessageError):
        wire.PoolLayout.from_dict({**LAYOUT.to_dict(), "num_layers": 0})


def test_factories():
    assert isinstance(make_transfer("fake", None, 16), FakeTransfer)
    with pytest.raises(ValueError):
        make_transfer("carrier-pigeon", None, 16)
    with pytest.raises(ValueError):
        make_transfer("shm", None, 16)
    with pytest.raises(ValueError):
        make_decode_pool("fake", LAYOUT, torch.float32, "127.0.0.1")


def test_decode_args_follow_the_dataclass():
    ap = argparse.ArgumentParser()
    add_decode_args(ap)
    ns = ap.parse_args(["--port", "0", "--page-size", "8", "--verify"])
    args = from_namespace(DecodeArgs, ns)
    assert (args.port, args.page_size, args.verify, args.host) == (0, 8, True, "127.0.0.1")
    assert DecodeArgs().receiver_listen.port == 30200 and DecodeArgs().port == 0
    assert DecodeArgs().disaggregation_transfer_backend == "shm"
    with pytest.raises(ValueError):
        DecodeArgs(max_total_tokens=8, page_size=16)
