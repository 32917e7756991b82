"""A sliding-window model's last window over shm to a `--verify` decode subprocess: it
passes, a damaged or too wide window fails; the verify check alone."""

from __future__ import annotations

import argparse

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.command import add_decode_args
from mpprefill.decode.verify import check_kv, reference_kv
from mpprefill.disagg import wire
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.plane_map import plane_view, pool_planes, window_swa_pages
from mpprefill.disagg.sender import KVPoll
from mpprefill.flags import from_namespace
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from tests.disagg.helpers import PAGE, DecodeProc, FakeReq, Router, bootstrap, wait_state
from tests.disagg.swa_helpers import SWA_FLAGS, WINDOW, filled_swa_pool, send_swa_chunks, swa_model

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_prefill_segments")]


@pytest.fixture(scope="module")
def swa_pool():
    return filled_swa_pool()


@pytest.fixture(scope="module")
def swa_decode():
    d = DecodeProc("--verify", *SWA_FLAGS).wait_ready()
    yield d
    left = d.close()
    assert not left, f"decode left segments behind: {left}\n{d.output()}"


@pytest.fixture
def backend(swa_pool, swa_decode):
    b = make_transfer("shm", swa_pool[0], PAGE, swa_decode.address, bootstrap_timeout=10.0)
    yield b
    b.close()


def _transfer(backend, address, p, rid, room, window=None):
    """Send one prompt as the scheduler would; (sender, router reply)."""
    with Router(address) as router:
        router.register(rid, room, p.ids)
        s = backend.create_sender(FakeReq(rid, room, len(p.ids)))
        bootstrap(s, p)
        send_swa_chunks(s, p, window)
        assert wait_state(s, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        return s, router.recv()


def test_window_arrives_verified_and_nothing_else(swa_pool, backend, swa_decode, room):
    kv, prompts = swa_pool
    full, swa = pool_planes(kv, PAGE)
    for i, p in enumerate(prompts):
        s, reply = _transfer(backend, swa_decode.address, p, f"sw{i}", room())
        assert reply["status"] == "done" and reply["first_token"] == p.first_token, reply
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
        dst, lo = s.target, p.window_start  # the decode pool, mapped as planes
        assert torch.equal(dst[full.dst_planes][:, s.dst_pages], full.view[:, p.pages])
        sent = s.dst_pages[lo:]
        assert torch.equal(dst[swa.dst_planes][:, sent], swa.view[:, p.window])
        assert dst[swa.dst_planes][:, s.dst_pages[:lo]].isnan().all()
    assert sum(p.window_start for p in prompts) > 0  # some SWA pages were left behind


def test_damaged_window_fails_verify(swa_pool, backend, swa_decode, room):
    kv, prompts = swa_pool
    p = prompts[0]
    planes = plane_view(kv.swa_buffer, PAGE)
    page = int(p.window[-1])
    saved = planes[:, page].clone()
    planes[0, page, :8] += 0.5  # K of the first SWA layer, last window page
    try:
        _, reply = _transfer(backend, swa_decode.address, p, "damaged", room())
    finally:
        planes[:, page] = saved
    assert reply["status"] == "done" and reply["verified"] is False, reply


def test_window_one_page_too_wide_fails_verify(swa_pool, backend, swa_decode, room):
    _, prompts = swa_pool
    p = prompts[0]
    assert p.window_start > 0
    wider = p.swa_pages[p.window_start - 1 :]  # one page that lies before the window
    _, reply = _transfer(backend, swa_decode.address, p, "wide", room(), window=wider)
    assert reply["status"] == "done" and reply["verified"] is False, reply


def test_check_kv_compares_the_window_and_wants_nan_before_it():
    model = swa_model()
    ids = list(range(1, 101))  # 100 tokens: window [68, 100), pages sent from 64
    want = reference_kv(model, ids, PAGE)
    got = want.clone()
    got[:, [0, 2], :64] = float("nan")
    assert check_kv(model.config, want, got, 0, PAGE)[0]
    for damage in ([0, 0, 70], [1, 0, 65], [1, 1, 3], [0, 2, 10]):
        bad = got.clone()
        bad[tuple(damage)] = 7.0  # window; sent, before it; full layer; SWA before the window
        ok = check_kv(model.config, want, bad, 0, PAGE)[0]
        assert ok is (damage == [1, 0, 65]), damage  # only [64, 68) is neither


def test_window_swa_pages_reads_the_allocator():
    alloc = SwaPagedAllocator(8, PAGE, 8)
    pages = alloc.alloc_pages(7)  # 100 tokens: window [68, 100), pages 4-6 sent
    row = alloc.slots_of(pages)
    alloc.free_swa(row[: 4 * PAGE])  # left the window
    got = window_swa_pages(alloc, row, 100, WINDOW)
    assert got.tolist() == alloc.swa_page_of[pages[4:]].tolist() and bool((got >= 0).all())
    alloc.free_swa(row[4 * PAGE : 5 * PAGE])
    assert window_swa_pages(alloc, row, 100, WINDOW).tolist()[0] == -1


def test_layout_counts_every_model_layer(swa_pool):
    kv, _ = swa_pool
    layout = wire.PoolLayout.of(kv.buffer, PAGE, kv.num_layers)
    assert layout.num_layers == 4 and kv.buffer.shape[1] == 2
    decode = wire.PoolLayout("float32", 4, 128 * PAGE, *kv.buffer.shape[3:], PAGE)
    assert layout.mismatch(decode) is None


def test_decode_swa_flags_are_the_servers():
    ap = argparse.ArgumentParser()
    add_decode_args(ap)
    args = from_namespace(DecodeArgs, ap.parse_args([*SWA_FLAGS]))
    assert (args.sliding_window, args.swa_layers) == (WINDOW, "sf")
    helps = {a.dest: a.help for a in ap._actions}
    server = ServerArgs.__dataclass_fields__
    assert helps["swa_layers"] == server["swa_layers"].metadata["help"]
    assert DecodeArgs().sliding_window is None
    with pytest.raises(ValueError):
        DecodeArgs(sliding_window=0)
