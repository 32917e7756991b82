"""HostKVStore and its page index: reserve, async write, retire, match, load, LRU, check."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.memory.host.store import HostKVStore, PoolWrite
from mpprefill.memory.host.writeback import WritebackBuffers
from mpprefill.memory.kv_cache import KVCache

PS = 4


def device_kv(num_slots: int = 64) -> KVCache:
    kv = KVCache(2, num_slots, 2, 8)
    kv.buffer.copy_(torch.randn(kv.buffer.shape))
    return kv


def make_store(num_pages: int, kv: KVCache | None = None) -> HostKVStore:
    return HostKVStore(num_pages * PS, PS, kv or device_kv())


def tokens(tag: int, num_pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(num_pages * PS)]


def hold(store: HostKVStore, gate: threading.Event) -> None:
    """Keep the copy thread busy until gate is set (10 s at most, so a failure cannot hang)."""
    store.copier.load([], before=lambda: gate.wait(10))


def write(store: HostKVStore, kv: KVCache, ids: list[int], device_slots: torch.Tensor):
    """Reserve and write back ids' missing pages from device_slots (one slot per token of ids)."""
    first, host_slots, entries, _ = store.reserve(ids)
    start = first * PS
    store.write(kv, PoolWrite(device_slots[start : start + len(host_slots)], host_slots), entries)
    return first, host_slots, entries


def test_pages_match_only_after_their_copy_is_retired():
    kv = device_kv()
    store = make_store(8, kv)
    ids, dev = tokens(1, 3) + [7, 7], torch.arange(14)
    gate = threading.Event()
    hold(store, gate)
    first, host_slots, entries = write(store, kv, ids, dev)
    assert first == 0 and len(entries) == 3 and len(host_slots) == 3 * PS  # the tail is no page
    assert store.match(ids) == [] and store.writes_in_flight == 1
    store.check()
    assert store.retire() == 0
    gate.set()
    assert store.retire(wait=True) == 3 * PS
    assert store.match(ids) == entries and store.writes_in_flight == 0
    assert torch.equal(store.kv.gather(host_slots), kv.gather(dev[: 3 * PS]))
    store.check()


def test_shared_prefix_is_stored_once_and_loads_back():
    kv = device_kv()
    store = make_store(8, kv)
    a, b = tokens(1, 3), tokens(1, 2) + tokens(2, 2)
    write(store, kv, a, torch.arange(12))
    first, host_slots, _ = write(store, kv, b, torch.arange(16, 32))
    assert first == 2 and len(host_slots) == 2 * PS  # only b's own pages
    store.retire(wait=True)
    assert len(store.match(b)) == 4 and len(store.index) == 5
    target = torch.arange(40, 56)
    store.load(store.match(b), kv, target).result()
    expect = torch.cat([torch.arange(8), torch.arange(24, 32)])
    assert torch.equal(kv.gather(target), kv.gather(expect))
    store.check()


def test_lru_evicts_least_recently_used_leaves_first():
    kv = device_kv()
    store = make_store(4, kv)
    a, b, c = tokens(1, 2), tokens(2, 2), tokens(3, 2)
    write(store, kv, a, torch.arange(8))
    write(store, kv, b, torch.arange(8, 16))
    store.retire(wait=True)
    store.match(a)  # a is now the most recent
    _, host_slots, _ = write(store, kv, c, torch.arange(16, 24))
    assert len(host_slots) == 2 * PS
    store.retire(wait=True)
    assert len(store.match(a)) == 2 and store.match(b) == [] and len(store.match(c)) == 2
    store.check()


def test_lru_on_branches_takes_the_least_recent_branch():
    kv = device_kv()
    store = make_store(4, kv)
    a, b = tokens(1, 2) + tokens(2, 1), tokens(1, 2) + tokens(3, 1)
    write(store, kv, a, torch.arange(12))
    write(store, kv, b, torch.arange(12, 24))
    store.retire(wait=True)
    store.match(b)  # touches the shared pages after a's own page
    write(store, kv, tokens(4, 1), torch.arange(24, 28))
    store.retire(wait=True)
    assert len(store.match(a)) == 2 and len(store.match(b)) == 3
    store.check()


def test_eviction_keeps_the_chain_being_extended():
    kv = device_kv()
    store = make_store(3, kv)
    a, b = tokens(1, 2), tokens(2, 1)
    write(store, kv, a, torch.arange(8))
    write(store, kv, b, torch.arange(8, 12))
    store.retire(wait=True)
    store.match(b)  # a's last page is the least recent leaf, but a is being extended
    first, host_slots, _ = write(store, kv, a + tokens(3, 1), torch.arange(16))
    assert first == 2 and len(host_slots) == PS
    store.retire(wait=True)
    assert len(store.match(a + tokens(3, 1))) == 3 and store.match(b) == []
    store.check()


def test_writes_in_flight_are_never_evicted():
    kv = device_kv()
    store = make_store(4, kv)
    write(store, kv, tokens(1, 2), torch.arange(8))
    store.retire(wait=True)  # two ready pages
    gate = threading.Event()
    hold(store, gate)
    write(store, kv, tokens(2, 2), torch.arange(8, 16))  # two pages in flight
    _, host_slots, _ = write(store, kv, tokens(3, 4), torch.arange(16, 32))
    assert len(host_slots) == 2 * PS  # only the two ready pages could be evicted
    _, host_slots, entries, _ = store.reserve(tokens(4, 1))
    assert len(host_slots) == 0 and entries == []  # everything is in flight now
    store.check()
    assert store.match(tokens(1, 2)) == []
    gate.set()
    store.retire(wait=True)
    assert len(store.match(tokens(2, 2))) == 2 and len(store.match(tokens(3, 4))) == 2
    store.check()


def test_bfloat16_pages_round_trip_bit_for_bit():
    """The store takes the pool's dtype; a write-back and a load move its bytes unchanged."""
    kv = KVCache(2, 64, 2, 8, torch.bfloat16)
    kv.buffer.copy_(torch.randn(kv.buffer.shape))
    store = make_store(8, kv)
    assert store.kv.dtype == torch.bfloat16 and store.buffers.dtype == torch.bfloat16
    ids, dev = tokens(1, 3), torch.arange(12)
    _, host_slots, _ = write(store, kv, ids, dev)
    store.retire(wait=True)
    bits = kv.gather(dev).view(torch.int16)
    assert torch.equal(store.kv.gather(host_slots).view(torch.int16), bits)
    target = torch.arange(40, 52)
    store.load(store.match(ids), kv, target).result()
    assert torch.equal(kv.gather(target).view(torch.int16), bits)
    assert store.buffers.spare_bytes() % 2 == 0 and store.buffers.spare_bytes() > 0
    store.check()


@pytest.mark.parametrize("page_order", ["whole pages", "slot by slot"])
def test_a_latent_pool_round_trips_its_one_plane(page_order):
    """A latent pool (multi-head latent attention: one row a token and layer, no V) is
    stored and loaded as it is, whole pages at a time or slot by slot."""
    kv = KVCache(3, 64, 1, 12, latent=True)
    kv.buffer.copy_(torch.randn(kv.buffer.shape))
    store = make_store(8, kv)
    assert store.kv.latent and store.kv.buffer.shape == (1, 3, 8 * PS, 1, 12)
    assert store.buffers.slot_numel == 3 * 12  # a slot's rows, one plane
    ids = tokens(1, 3)
    dev = torch.arange(12) if page_order == "whole pages" else torch.arange(12).flip(0)
    _, host_slots, _ = write(store, kv, ids, dev)
    store.retire(wait=True)
    assert torch.equal(store.kv.gather(host_slots), kv.gather(dev))
    target = torch.arange(40, 52)
    store.load(store.match(ids), kv, target).result()
    assert torch.equal(kv.gather(target), kv.gather(dev))
    store.check()
    store.close()


def test_writeback_buffers_take_one_or_two_planes():
    assert WritebackBuffers(2, 1, 4, torch.float32, planes=1).slot_numel == 8
    assert WritebackBuffers(2, 1, 4, torch.float32).slot_numel == 16
    with pytest.raises(ValueError, match="1 plane"):
        WritebackBuffers(2, 1, 4, torch.float32, planes=3)


def test_check_catches_a_page_freed_while_held():
    kv = device_kv()
    store = make_store(4, kv)
    _, host_slots, _ = write(store, kv, tokens(1, 2), torch.arange(8))
    store.retire(wait=True)
    store.check()
    store.pages.free(host_slots[:PS])
    with pytest.raises(AssertionError):
        store.check()


def test_writeback_buffers_are_reused_once_their_copy_is_done():
    kv = device_kv()
    store = make_store(8, kv)
    gate = threading.Event()
    hold(store, gate)
    write(store, kv, tokens(1, 2), torch.arange(8))
    write(store, kv, tokens(2, 1), torch.arange(8, 12))
    assert store.buffers.spare_bytes() == 0  # the copy thread has not run them yet
    gate.set()
    store.retire(wait=True)
    spare = store.buffers.spare_bytes()
    assert spare == 8 * store.buffers.slot_numel * 4  # one buffer served both copies
    write(store, kv, tokens(3, 2), torch.arange(12, 20))
    store.retire(wait=True)
    assert store.buffers.spare_bytes() == spare
    assert torch.equal(
        store.kv.gather(store.slots_of(store.match(tokens(3, 2)))), kv.gather(torch.arange(12, 20))
    )


def test_a_load_runs_after_the_copies_before_it_and_after_its_fence():
    kv = device_kv()
    store = make_store(8, kv)
    write(store, kv, tokens(1, 2), torch.arange(8))
    store.retire(wait=True)
    gate, fenced = threading.Event(), threading.Event()
    hold(store, gate)
    target = torch.arange(40, 48)
    before = kv.gather(target).clone()
    load = store.load(store.match(tokens(1, 2)), kv, target, before=fenced.set)
    assert not load.done() and torch.equal(kv.gather(target), before)  # queued behind
    gate.set()
    load.result(timeout=10)
    assert fenced.is_set() and torch.equal(kv.gather(target), kv.gather(torch.arange(8)))
    store.close()


def test_flush_drops_every_page_once_the_copies_in_flight_ran():
    kv = device_kv()
    store = make_store(8, kv)
    write(store, kv, tokens(1, 3), torch.arange(12))
    with pytest.raises(RuntimeError, match="not retired"):
        store.flush()  # the caller retires its writes first
    store.retire(wait=True)
    gate = threading.Event()
    hold(store, gate)
    load = store.load(store.match(tokens(1, 3)), kv, torch.arange(40, 52))
    flushed = []
    flusher = threading.Thread(target=lambda: flushed.append(store.flush()))
    flusher.start()
    flusher.join(0.2)
    assert flusher.is_alive() and not load.done()  # the load still reads those pages
    gate.set()
    flusher.join(10)
    assert load.done() and flushed == [3 * PS]
    assert len(store.index) == 0 and store.match(tokens(1, 3)) == []
    assert store.pages.num_free_pages == store.pages.num_pages
    store.check()
    write(store, kv, tokens(1, 3), torch.arange(12))  # the store works on after a flush
    store.retire(wait=True)
    assert len(store.match(tokens(1, 3))) == 3
    store.check()
    store.close()


def test_empty_store_is_refused():
    with pytest.raises(ValueError, match="no page"):
        HostKVStore(PS - 1, PS, device_kv())


op = st.tuples(st.sampled_from(["write", "retire", "match"]), st.integers(0, 5), st.integers(1, 4))


@settings(max_examples=40, deadline=None)
@given(st.lists(op, max_size=30))
def test_random_operations_keep_the_store_consistent(ops):
    kv = device_kv(128)
    store = make_store(6, kv)
    gate = threading.Event()
    hold(store, gate)
    for name, group, pages in ops:
        ids = tokens(group % 3, 1) + tokens(group, pages)  # three shared first pages
        if name == "write":
            write(store, kv, ids, torch.arange(len(ids)))
        elif name == "retire":
            gate.set()
            store.retire(wait=bool(group % 2))
        else:
            held = store.match(ids)
            assert all(e.ready for e in held)
        store.check()
    gate.set()
    store.retire(wait=True)
    store.check()
    assert store.writes_in_flight == 0
