"""The host tier's copies off the scheduler thread: write-backs hold their tree pages until
they retire, loads wait for the KV write fence and are waited for before a read."""

from __future__ import annotations

import threading

import pytest
import torch

from mpprefill.worker.fence import KVWriteFence
from tests.scheduling.test_host_store_swa_tier import PS, SwaDevice, system
from tests.scheduling.test_host_store_tier import Device, only_on_the_host


def hold(tier) -> threading.Event:
    """Keep the copy thread busy until the returned gate is set (10 s at most)."""
    gate = threading.Event()
    tier.store.copier.load([], before=lambda: gate.wait(10))
    return gate


def test_a_write_back_in_flight_keeps_its_pages_from_eviction():
    dev = Device(num_pages=8)
    tier = dev.tier()
    ids = list(range(1, 4 * PS + 2))
    req = dev.finish(ids)
    want = dev.kv.gather(req.prefix_indices[: 4 * PS]).clone()
    gate = hold(tier)
    tier.write_back([req])  # planned and locked; the copy waits behind the gate
    dev.release(req)
    assert dev.tree.protected_size() == 4 * PS  # the write's own lock
    assert dev.tree.evict(10**6) == 0  # nothing can be freed and reused under the copy
    assert tier.retire() == 0 and dev.tree.protected_size() == 4 * PS
    gate.set()
    assert tier.retire(wait=True) == 4 * PS
    assert dev.tree.protected_size() == 0 and dev.tree.evict(10**6) == 4 * PS
    held = tier.store.match(ids)
    assert torch.equal(tier.store.kv.gather(tier.store.slots_of(held)), want)
    assert tier.staging_log[-1][0] == 1  # one finishing request in that write
    tier.check()
    dev.tree.check()
    dev.alloc.check()


def test_swa_checkpoints_in_flight_keep_their_window():
    dev = SwaDevice()
    tier = dev.tier()
    ids = system(6 * PS) + [7]
    req = dev.finish(ids)
    gate = hold(tier)
    tier.write_back([req])
    dev.release(req)
    window = req.prefix_indices[4 * PS : 6 * PS]  # [16, 24): what the checkpoint copies
    assert dev.tree.swa_protected_size() > 0
    assert dev.tree.evict_swa(10**6) > 0  # pages before the window go, the window stays
    assert bool(dev.alloc.has_swa(window).all())
    gate.set()
    tier.retire(wait=True)
    assert dev.tree.protected_size() == dev.tree.swa_protected_size() == 0
    dev.check(tier)


def test_a_load_waits_for_the_fence_and_is_waited_for_before_a_read():
    dev = Device()
    written = threading.Event()
    dev_fence = KVWriteFence(32, PS, lambda seq: written.wait(10), lambda seq: written.is_set())
    tier = dev.tier()
    tier.fence = dev_fence
    ids = list(range(1, 3 * PS + 2))
    req = only_on_the_host(dev, tier, ids)
    want = dev.kv.gather(req.prefix_indices[: 3 * PS]).clone()
    dev.kv.buffer.zero_()
    # forward 7, still running, writes every page: a load into any of them must wait
    dev_fence.note_writes(7, torch.arange(32 * PS))
    match, left = tier.match_prefix(ids, 3 * PS, lambda: 100, partial=False)
    assert left == 0 and len(match.indices) == 3 * PS  # planned: in the tree already
    pending = tier._loads[-1]
    assert not pending.done()
    assert not bool(dev.kv.gather(match.indices).any())  # not written before forward 7 ends
    written.set()
    tier.wait_loads()
    assert torch.equal(dev.kv.gather(match.indices), want)
    tier.close()


def test_a_failed_load_raises_on_the_scheduler_thread_and_close_still_ends():
    dev = Device()
    tier = dev.tier()
    ids = list(range(1, 2 * PS + 2))
    only_on_the_host(dev, tier, ids)

    def dead(seq: int) -> None:
        raise RuntimeError(f"forward process died before forward {seq} ended")

    tier.fence = KVWriteFence(32, PS, dead, lambda seq: False)
    tier.fence.note_writes(3, torch.arange(32 * PS))
    tier.match_prefix(ids, 2 * PS, lambda: 100, partial=False)
    with pytest.raises(RuntimeError, match="died"):
        tier.wait_loads()
    tier.close()  # ends, and the copy thread with it
    with pytest.raises(RuntimeError):
        tier.store.copier.load([])
