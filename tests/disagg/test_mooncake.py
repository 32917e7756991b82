"""The same happy path over the Mooncake transfer engine on loopback TCP (skips without it)."""

from __future__ import annotations

import pytest
import torch

from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.sender import KVPoll
from tests.disagg.helpers import (
    PAGE,
    DecodeProc,
    FakeReq,
    Router,
    bootstrap,
    send_chunks,
    wait_state,
)
from tests.mooncake_check import skip_without_mooncake

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_prefill_segments")]


@pytest.fixture(scope="module")
def mooncake_decode():
    skip_without_mooncake()
    d = DecodeProc("--verify", backend="mooncake").wait_ready()
    yield d
    assert not d.close()


def test_happy_path_over_mooncake(pool, mooncake_decode):
    kv, prompts = pool
    b = make_transfer("mooncake", kv, PAGE, mooncake_decode.address, bootstrap_timeout=10.0)
    try:
        with Router(mooncake_decode.address) as rt:
            senders = []
            for i, p in enumerate(prompts):
                rt.register(f"mc{i}", 500 + i, p.ids)
                senders.append(b.create_sender(FakeReq(f"mc{i}", 500 + i, len(p.ids))))
            for s, p in zip(senders, prompts):
                bootstrap(s, p)
                send_chunks(s, p, chunk_pages=2)
            for s in senders:
                state = wait_state(s, (KVPoll.Success, KVPoll.Failed), timeout=20)
                assert state == KVPoll.Success, s.failure_reason()
            replies = rt.recv_many(len(prompts))
        for i, p in enumerate(prompts):
            reply = replies[f"mc{i}"]
            assert reply["status"] == "done" and reply["first_token"] == p.first_token, reply
            assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
        assert [s.pages_sent for s in senders] == [p.num_pages for p in prompts]
    finally:
        b.close()


def test_chunks_merge_page_runs(pool, mooncake_decode):
    """Runs of consecutive pages on both sides become one chunk per (K/V, layer)."""
    kv, _ = pool
    b = make_transfer("mooncake", kv, PAGE, mooncake_decode.address)
    try:
        src = torch.tensor([4, 5, 6, 9, 10])
        dst = torch.tensor([0, 1, 2, 3, 7])
        addrs, _, lens = b._chunks(src, dst, b.layout, 1 << 20, b.planes[0][0])
        runs = 3  # [4,5,6]->[0,1,2], [9]->[3], [10]->[7]
        assert len(addrs) == 2 * kv.num_layers * runs
        page_bytes = PAGE * kv.bytes_per_slot // (2 * kv.num_layers)
        assert lens[:3] == [3 * page_bytes, page_bytes, page_bytes]
    finally:
        b.close()
