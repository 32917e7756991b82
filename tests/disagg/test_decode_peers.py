"""The decode receiver among peers it cannot trust: rooms bound to their router and prefill,
replies carrying the receiver's run, and every queue, frame, message and wait bounded."""

from __future__ import annotations

import time

import pytest
import zmq

from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg import wire
from tests.disagg.helpers import PAGE, Router, serving

pytestmark = pytest.mark.timeout(30)


def _receiver(**kw) -> DecodeReceiver:
    return DecodeReceiver(DecodeArgs(receiver_port=0, max_total_tokens=2 * PAGE, **kw))


def _bootstrap(prefill: Router, room: int) -> dict:
    prefill.send({"type": "bootstrap", "room": room})
    return prefill.recv()


def _done(room: int, instance: str, num_pages: int = 1) -> dict:
    return {
        "type": "transfer_done",
        "room": room,
        "first_token": 7,
        "num_pages": num_pages,
        "instance": instance,
    }


def test_a_room_belongs_to_the_prefill_that_bootstrapped_it():
    rx = _receiver()
    with (
        serving(rx),
        Router(rx.address) as router,
        Router(rx.address) as prefill,
        Router(rx.address) as stranger,
    ):
        router.register("own", 1, [1] * PAGE)
        router.sync()
        assert _bootstrap(prefill, 1)["status"] == "ready"
        taken = _bootstrap(stranger, 1)
        assert taken["status"] == "error" and "another prefill" in taken["error"]
        stranger.send(_done(1, rx.instance))
        assert stranger.recv()["ok"] is False
        stranger.send({"type": "abort", "room": 1})
        assert stranger.recv() == {"type": "error", "error": "unknown room 1", "room": 1}
        assert router.recv(0.3, missing_ok=True) is None  # the room lives on
        prefill.send(_done(1, rx.instance))
        assert prefill.recv() == {"type": "ack", "room": 1, "ok": True, "error": None,
                                  "instance": rx.instance}  # fmt: skip
        done = router.recv()
        assert done.pop("emitted_at") <= time.monotonic()  # the decode's stamp, this host's clock
        assert done == {"rid": "own", "status": "done", "first_token": 7}


def test_a_restarted_receiver_does_not_ack_what_its_predecessor_received():
    """A transfer_done names the run that answered its bootstrap; another run refuses it."""
    rx = _receiver()
    with serving(rx), Router(rx.address) as router, Router(rx.address) as prefill:
        router.register("re", 2, [1] * PAGE)
        router.sync()
        reply = _bootstrap(prefill, 2)
        assert reply["instance"] == rx.instance and len(rx.instance) >= 16
        prefill.send(_done(2, "an-earlier-run"))
        ack = prefill.recv()
        assert ack["ok"] is False and ack["instance"] == rx.instance
        assert router.recv(0.3, missing_ok=True) is None
        prefill.send(_done(2, rx.instance))
        assert prefill.recv()["ok"] is True
        assert router.recv()["status"] == "done"


def test_a_room_that_gets_no_kv_times_out():
    rx = _receiver(waiting_timeout=0.3)
    with serving(rx), Router(rx.address) as router, Router(rx.address) as prefill:
        router.register("late", 3, [1] * PAGE)
        router.register("never", 4, [1] * PAGE)  # not bootstrapped by any prefill
        router.sync()
        assert _bootstrap(prefill, 3)["status"] == "ready"
        t0 = time.monotonic()
        errors = [router.recv(3), router.recv(3)]
        assert time.monotonic() - t0 >= 0.2
        assert {e["rid"] for e in errors} == {"late", "never"}
        assert all("no KV within 0.3 s" in e["error"] for e in errors)
        assert prefill.recv() == {"type": "abort", "room": 3}
        router.sync()
        assert rx.allocator.num_free_pages == 1  # room 3 waits for the prefill to stop
        prefill.send({"type": "abort", "room": 3})
        prefill.sync()
        assert rx.allocator.num_free_pages == 2


def test_waiting_registrations_are_capped():
    rx = _receiver(max_queued_registrations=1)
    with serving(rx), Router(rx.address) as router:
        router.register("fills", 5, [1] * (2 * PAGE))
        router.register("waits", 6, [1])
        router.register("refused", 7, [1])
        reply = router.recv()
        assert reply["rid"] == "refused" and "already wait" in reply["error"]
        router.send({"type": "abort", "room": 6})
        assert router.recv() == {"rid": "waits", "status": "error", "error": "aborted"}


def test_errors_quote_a_bad_value_briefly():
    rx = _receiver()
    with serving(rx), Router(rx.address) as router:
        bad = {"type": "register", "rid": "e", "bootstrap_room": "x" * 100_000, "input_ids": [1]}
        router.send(bad)
        reply = router.recv()
        assert reply["rid"] == "e" and len(reply["error"]) < 300, len(reply["error"])
        router.send({"type": "bootstrap", "room": 2**64})
        reply = router.recv()
        assert reply["type"] == "error" and len(reply["error"]) < 300


def test_a_frame_beyond_the_limit_drops_its_connection_only():
    rx = _receiver()
    assert rx.sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_FRAME_BYTES
    with serving(rx), Router(rx.address) as big, Router(rx.address) as router:
        head = b'{"type": "register", "rid": "huge", "bootstrap_room": 9, "input_ids": ['
        big.send_raw(head + b"1," * (wire.MAX_FRAME_BYTES // 2) + b"1]}")
        assert big.recv(1.0, missing_ok=True) is None
        router.sync()
        assert 9 not in rx.pending and 9 not in rx.rooms
