from __future__ import annotations

import os
import time
from dataclasses import dataclass

import msgspec
import pytest

import ipc
from tests.ipc import children
from tests.ipc.children import Note


def test_one_slot_put_waits_for_take(ctx, endpoint, procs):
    ch = ipc.Channel(endpoint, bind=True)
    p = ctx.Process(target=children.slow_taker, args=(endpoint, os.getpid(), 0.5))
    p.start()
    procs.append(p)
    ch.set_peer(p.pid)
    ch.put(Note(1), timeout=10)
    with pytest.raises(ipc.MailboxFull):
        ch.put(Note(2), timeout=0.05)  # the child sleeps before taking the first
    ch.put(Note(-1), timeout=10)  # blocks until the first is taken
    p.join(30)
    assert p.exitcode == 0
    ch.close()


def test_get_timeout(endpoint):
    a = ipc.Channel(endpoint, bind=True)
    b = ipc.Channel(endpoint, bind=False)
    with pytest.raises(ipc.MailboxTimeout):
        a.get(timeout=0.05)
    b.put(Note(3, "hi"), timeout=1)
    assert a.poll(5.0)
    got = a.get(timeout=5)
    assert (got.seq, got.text, got.handle) == (3, "hi", None)
    a.close()
    b.close()


def test_duplex_mailboxes_are_independent(endpoint):
    a = ipc.Channel(endpoint, bind=True)
    b = ipc.Channel(endpoint, bind=False)
    a.put(Note(1), timeout=1)
    b.put(Note(2), timeout=1)  # b's own slot is free even though a's message is pending
    assert b.get(timeout=5).seq == 1
    assert a.get(timeout=5).seq == 2
    a.put(Note(3), timeout=5)
    assert b.get(timeout=5).seq == 3
    a.close()
    b.close()


def test_peer_death_detected_on_get(ctx, endpoint, procs):
    ch = ipc.Channel(endpoint, bind=True)
    p = ctx.Process(target=children.sleeper, args=(endpoint, os.getpid()))
    p.start()
    procs.append(p)
    ch.set_peer(p.pid)
    ch.get(timeout=30)
    p.kill()
    t0 = time.monotonic()
    with pytest.raises(ipc.PeerDied):
        ch.get(timeout=30)
    assert time.monotonic() - t0 < 2.0  # liveness bound, generous for a loaded machine
    ch.close()


def test_peer_death_detected_on_put(ctx, endpoint, procs):
    ch = ipc.Channel(endpoint, bind=True)
    p = ctx.Process(target=children.self_kill, args=(endpoint, os.getpid()))
    p.start()
    procs.append(p)
    ch.set_peer(p.pid)
    ch.put(Note(1), timeout=30)  # the child takes it, then kills itself
    p.join(30)
    with pytest.raises(ipc.PeerDied):
        ch.put(Note(2), timeout=30)
        ch.put(Note(3), timeout=30)
    ch.close()


def test_codec_rejects_unknown_and_unregistered():
    @dataclass
    class Loose:
        x: int

    class Untagged(ipc.Message):
        x: int

    with pytest.raises(ipc.MessageError, match="Loose"):
        ipc.encode(Loose(1))
    with pytest.raises(TypeError, match="tagged"):
        ipc.message(Untagged)
    evil = msgspec.msgpack.encode({"type": "Note", "seq": 1, "evil": 2})
    with pytest.raises(ipc.MessageError, match="evil"):
        ipc.decode(evil)
    with pytest.raises(ipc.MessageError, match="seq"):
        ipc.decode(msgspec.msgpack.encode({"type": "Note", "seq": "1"}))
    with pytest.raises(ipc.MessageError, match="type"):
        ipc.decode(msgspec.msgpack.encode({"type": "Nope", "seq": 1}))
    with pytest.raises(ipc.MessageError):
        ipc.decode(b"\xc1not msgpack")
    with pytest.raises(ipc.MessageError):
        ipc.encode(Note(1, text=object()))  # type: ignore[arg-type]


def test_codec_round_trips_a_handle():
    h = ipc.TensorHandle("shm", "seg", "int64", (3, 4), 8, 96)
    data = ipc.encode(Note(5, "x", h))
    assert ipc.decode(data) == Note(5, "x", h)
    assert msgspec.msgpack.decode(ipc.encode(Note(7))) == {
        "type": "Note",
        "seq": 7,
        "text": "",
        "handle": None,
    }
    bad = msgspec.msgpack.decode(data)
    bad["handle"]["shape"] = [3, -4]
    with pytest.raises(ipc.MessageError, match=r"handle\.shape"):
        ipc.decode(msgspec.msgpack.encode(bad))
