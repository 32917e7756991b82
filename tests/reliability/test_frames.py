"""The client frame builders: what they make is what the server's parser accepts."""

from __future__ import annotations

import json

from mpprefill.server import protocol


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


def test_abort_frame_parses_back():
    assert protocol.parse_frame(protocol.abort_frame("r3")) == protocol.Abort("r3")
