"""The sliding window a cached prefix must keep: a query at m reads keys m - W < j <= m, so
a match, a lock and a transfer need SWA KV of [m - W + 1, m) and nothing before it."""

from __future__ import annotations

from mpprefill.disagg.plane_map import window_first_page
from tests.memory.test_swa_radix_cache import A, Sim, check_all, matched, put


def lock_at(sim: Sim, n: int):
    node = sim.cache.match_prefix(A[:n]).last_node
    assert node.end == n
    sim.cache.inc_lock_ref(node)
    return node


def test_w_one_more_than_a_page_multiple_needs_one_page_before_the_match():
    sim = Sim(page_size=4, window=5)  # W = 1 (mod page): [m - 4, m) is exactly one page
    put(sim, A[:16])
    for n in (4, 8, 12):
        matched(sim, A[:n])  # nodes [0, 4) [4, 8) [8, 12) [12, 16)
    at16 = lock_at(sim, 16)
    assert sim.cache.swa_protected_size() == 4  # [12, 16); [11, 16) would pin [8, 12) too
    others = [lock_at(sim, 4), lock_at(sim, 8)]  # SWA-lock [0, 4) and [4, 8)
    assert sim.cache.swa_protected_size() == 12
    assert sim.cache.evict_swa(100) == 4  # only [8, 12) is outside every locked window
    check_all(sim)
    for node in (at16, *others):
        sim.cache.dec_lock_ref(node)
    assert matched(sim, A[:16]) == 16  # its window [12, 16) is whole: the page saved
    assert matched(sim, A[:12]) == 8  # [8, 12) is the window of 12
    check_all(sim)
    sim.drain()


def test_a_one_token_window_needs_no_swa_kv_before_the_query():
    sim = Sim(page_size=4, window=1)
    put(sim, A[:16])
    assert sim.cache.evict_swa(100) == 16  # nothing locks SWA KV
    assert matched(sim, A[:16]) == 16  # all tombstones, still a whole-prefix hit
    node = lock_at(sim, 16)
    assert sim.cache.swa_protected_size() == 0 and sim.cache.protected_size() == 16
    check_all(sim)
    sim.cache.dec_lock_ref(node)
    sim.drain()


def test_a_chunked_prompt_keeps_only_w_minus_1_keys_warm():
    sim = Sim(page_size=4, num_swa_pages=6, window=5, chunk=8, free=True)
    req = sim.admit(A)
    while not req.done:
        assert sim.step(req)
        check_all(sim)  # the window [kv_len - 4, kv_len) is held by the lock
        assert sim.swa_used() == 4 + (sim.page_size if req.done else 0)
    sim.release(req)
    again = sim.admit(A)
    assert again.cached_tokens == 60
    sim.release(again)
    sim.drain()


def test_the_transfer_window_starts_at_l_minus_w_plus_1():
    # L = 16, W = 5: keys [12, 16) are sent, page 3 only (the wider window took page 2 too)
    assert window_first_page(16, 5, 4) == 3
    assert window_first_page(18, 5, 4) == 3  # [14, 18): pages 3 and 4
    assert window_first_page(16, 4, 4) == 3  # [13, 16)
    assert window_first_page(3, 9, 4) == 0  # the whole prompt
    assert window_first_page(16, 1, 4) == 4 and window_first_page(18, 1, 4) == 5  # no page
