"""The client frame builders: what they make is what the server's parser accepts."""

from __future__ import annotations

import json

import pytest

from ipc.codec import MessageError
from mpprefill import protocol


def test_generate_frame_parses_back():
    frame = protocol.generate_frame("r1", [1, 2, 3], {"temperature": 0.5}, bootstrap_room=7)
    msg = protocol.parse_frame(frame)
    assert isinstance(msg, protocol.Generate)
    assert (msg.rid, msg.input_ids, msg.bootstrap_room) == ("r1", [1, 2, 3], 7)
    assert msg.sampling_params.temperature == 0.5


def test_generate_frame_defaults_to_greedy_and_no_room():
    obj = json.loads(protocol.generate_frame("r2", [4]))
    assert obj == {
        "type": "generate",
        "rid": "r2",
        "input_ids": [4],
        "sampling_params": {"temperature": 0.0},
    }


def test_generate_frame_rid_readable_from_its_head():
    """An oversize frame is answered by the rid in its head; the builder keeps it there."""
    frame = protocol.generate_frame("big", [1] * 100_000)
    assert protocol.sniff_rid(frame[: protocol.SNIFF_BYTES]) == "big"


def test_generate_frame_carries_the_decode_sides_fields():
    frame = protocol.generate_frame(
        "r", [1], {"max_new_tokens": 4, "stop_token_ids": [2]}, 7, "10.0.0.1", 8998, stream=True
    )
    msg = protocol.parse_frame(frame)
    assert (msg.bootstrap_room, msg.bootstrap_host, msg.bootstrap_port, msg.stream) == (
        7,
        "10.0.0.1",
        8998,
        True,
    )
    assert msg.sampling_params.max_new_tokens == 4 and msg.sampling_params.stop_token_ids == (2,)
    plain = protocol.parse_frame(protocol.generate_frame("r", [1]))
    assert (plain.bootstrap_host, plain.bootstrap_port, plain.stream) == (None, None, False)


def test_generate_frame_refuses_bad_decode_fields():
    import pytest

    base = {"type": "generate", "rid": "r", "input_ids": [1]}
    for extra, field in [
        ({"bootstrap_port": 0}, "bootstrap_port"),
        ({"bootstrap_port": "80"}, "bootstrap_port"),
        ({"bootstrap_host": ""}, "bootstrap_host"),
        ({"bootstrap_host": "h" * 300}, "bootstrap_host"),
        ({"stream": 1}, "stream"),
    ]:
        with pytest.raises(MessageError, match=field):
            protocol.parse_frame(json.dumps(base | extra).encode())


def test_done_and_partial_replies():
    done = json.loads(protocol.done_reply("r", 5, 3, 1))
    assert done["output_ids"] == [5] and done["completion_tokens"] == 1
    assert done["finish_reason"] == {"type": "length", "length": 1}
    stop = {"type": "stop", "matched": 2}
    done = json.loads(protocol.done_reply("r", 5, 3, 1, [5, 6, 2], stop))
    assert (done["output_ids"], done["completion_tokens"], done["finish_reason"]) == (
        [5, 6, 2],
        3,
        stop,
    )
    assert json.loads(protocol.partial_reply("r", [6])) == {
        "rid": "r",
        "status": "partial",
        "output_ids": [6],
    }


def test_abort_frame_parses_back():
    assert protocol.parse_frame(protocol.abort_frame("r3")) == protocol.Abort("r3")


def test_a_refused_frame_keeps_a_rid_it_can_send_back():
    """msgspec refuses NaN, which Python's json writes: the rid still comes back; a rid with
    a lone surrogate cannot be sent back, so the error has none."""
    nan = json.dumps({"type": "generate", "input_ids": [float("nan")], "rid": "n1"}).encode()
    surrogate = json.dumps({"type": "generate", "rid": "a\ud800", "input_ids": [1]}).encode()
    for frame, rid in ((nan, "n1"), (surrogate, None)):
        with pytest.raises(MessageError) as e:
            protocol.parse_frame(frame)
        assert (e.value.rid, e.value.code) == (rid, protocol.Code.BAD_REQUEST)
        assert json.loads(protocol.error_reply(e.value.rid, str(e.value)))["rid"] == rid


def test_requests_leave_defaults_out_and_refuse_unknown_fields():
    assert json.loads(protocol.request_frame(protocol.Stats())) == {"type": "stats"}
    profile = protocol.StartProfile("p", "/tmp/out")
    assert protocol.parse_frame(protocol.request_frame(profile)) == profile
    for obj, field in [
        ({"type": "abort", "rid": "a", "x": 1}, "x"),
        ({"type": "start_profile", "output_dir": "/o", "activities": ["TPU"]}, "activities"),
        ({"type": "start_profile", "output_dir": "/o", "num_steps": 0}, "num_steps"),
        ({"type": "generate", "rid": "r" * 257, "input_ids": [1]}, "rid"),
    ]:
        with pytest.raises(MessageError, match=field):
            protocol.parse_frame(json.dumps(obj).encode())
