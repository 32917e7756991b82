"""Which pages each send writes into which pool planes, and how a reply's pool is checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.disagg import wire
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.transfer_sender import TransferCmd
from mpprefill.memory.kv_cache import KVCache

PAGE = 4


def pool(heads: int = 2, swa: bool = False) -> KVCache:
    """3 layers of 64 slots; with `swa`, layer 1 slides in a pool of 32 slots."""
    kw = {"swa_layers": (1,), "num_swa_slots": 32} if swa else {}
    return KVCache(3, 64, heads, 8, **kw)


def send(src, dst, swa_src=None, swa_dst=None) -> TransferCmd:
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return TransferCmd("send", None, t(src), t(dst), swa_src=t(swa_src), swa_dst=t(swa_dst))


def test_a_send_writes_its_full_pages_to_every_layer_of_the_pool():
    pages = PageWrites(ShippedKV.of(pool()), PAGE)
    cmd = send([5, 2], [0, 1])
    [(src, dst, planes)] = pages.writes(cmd)
    assert src is cmd.src and dst is cmd.dst and planes is pages.planes[0][0]
    assert planes.dst_planes.tolist() == [0, 1, 2, 3, 4, 5]  # K of layers 0-2, then V
    limits = pages.limits(1.0, 2.0)
    assert (limits.num_pages, limits.swa_num_pages) == (16, None)
    assert (limits.answer_timeout, limits.transfer_timeout) == (1.0, 2.0)


def test_the_last_window_goes_to_the_sliding_layers_planes():
    pages = PageWrites(ShippedKV.of(pool(swa=True)), PAGE)
    full, swa = pages.planes[0]
    cmd = send([5, 2], [0, 1], swa_src=[3], swa_dst=[1])
    writes = pages.writes(cmd)
    assert [w[2] for w in writes] == [full, swa]
    assert writes[1][0] is cmd.swa_src and writes[1][1] is cmd.swa_dst
    assert full.dst_planes.tolist() == [0, 2, 3, 5] and swa.dst_planes.tolist() == [1, 4]
    assert [w[2] for w in pages.writes(send([5], [0], [], []))] == [full]  # empty window
    assert pages.limits(1.0, 2.0).swa_num_pages == 8


def test_a_last_send_without_pages_moves_none():
    pages = PageWrites(ShippedKV.of(pool(swa=True)), PAGE)
    assert not pages.moves_pages(send([], []))
    assert not pages.moves_pages(send([], [], [], []))
    assert pages.moves_pages(send([], [], [3], [1]))
    assert pages.moves_pages(send([2], [0]))


def test_each_tensor_parallel_pool_writes_its_own_heads():
    shards = [(pool(1), range(0, 1)), (pool(1), range(0, 1)), (pool(1), range(1, 2))]
    pages = PageWrites(ShippedKV.of(shards), PAGE)
    writes = pages.writes(send([5], [0]))
    assert [w[2].heads for w in writes] == [range(0, 1), range(1, 2)]  # rank 1 is not read
    assert writes[0][2].view.data_ptr() == shards[0][0].buffer.data_ptr()
    assert pages.bootstrap(9) == wire.Bootstrap(9, 3, [[0, 1], [1, 2]], "float32", "heads", 8)
    assert pages.layout.num_kv_heads == 2


def reply(dst, prefix=0) -> wire.BootstrapReply:
    return wire.BootstrapReply(9, "ready", {}, dst, prefix, instance="run-1")


def test_a_reply_is_checked_against_this_pool():
    pages = PageWrites(ShippedKV.of(pool()), PAGE)
    remote = dataclasses.replace(pages.layout, num_slots=32)  # a smaller decode pool: fine
    assert pages.check_reply(reply([7, 0], prefix=4), remote).tolist() == [7, 0]
    with pytest.raises(ValueError, match="pool layouts differ in \\['head_dim'\\]"):
        pages.check_reply(reply([0]), dataclasses.replace(remote, head_dim=16))
    with pytest.raises(ValueError, match=r"destination page out of range \[0, 8\)"):
        pages.check_reply(reply([8]), remote)
    with pytest.raises(ValueError, match="bad decode_prefix_len 3"):
        pages.check_reply(reply([0, 1], prefix=3), remote)
    with pytest.raises(ValueError, match="bad decode_prefix_len 12"):
        pages.check_reply(reply([0, 1], prefix=12), remote)


def test_a_page_size_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="bad page size 128 for a pool of 64 slots"):
        PageWrites(ShippedKV.of(pool()), 128)
