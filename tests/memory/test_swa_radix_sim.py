"""SwaRadixCache driven at random through the scheduler's steps, checked after each one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.memory.test_swa_radix_cache import A, Sim, check_all, put

BASES = [[(g * 31 + i * 7) % 11 for i in range(72)] for g in range(3)]
prompt_st = st.builds(
    lambda g, k, tail: (BASES[g][:k] + tail) or [1],
    st.integers(0, 2),
    st.sampled_from([0, 5, 16, 31, 32, 48]),
    st.lists(st.integers(0, 3), max_size=20),
)
OPS = ["admit"] * 3 + ["step"] * 4 + ["release"] * 2
OPS += ["lock", "unlock", "insert", "evict", "evict_swa"]
op_st = st.tuples(st.sampled_from(OPS), st.integers(0, 64), prompt_st)


def apply(sim: Sim, op: str, n: int, prompt: list[int]) -> None:
    if op == "admit":
        sim.admit(prompt)
    elif op == "step" and sim.reqs:
        req = sim.reqs[n % len(sim.reqs)]
        if not req.done:
            sim.step(req)
    elif op == "release" and sim.reqs:
        sim.release(sim.reqs[n % len(sim.reqs)])
    elif op == "unlock" and sim.locks:
        sim.cache.dec_lock_ref(sim.locks.pop(n % len(sim.locks)))
    elif op == "lock":
        sim.locks.append(sim.cache.match_prefix(prompt).last_node)
        sim.cache.inc_lock_ref(sim.locks[-1])
    elif op == "insert" and sim.alloc.num_free_pages * sim.page_size > len(prompt):
        put(sim, prompt)
    elif op == "evict":
        sim.cache.evict(n)
    elif op == "evict_swa":
        sim.cache.evict_swa(n)


@pytest.mark.parametrize(
    ("page_size", "num_pages", "num_swa_pages", "window", "chunk", "disable", "free"),
    [(4, 40, 10, 8, 8, False, False), (1, 96, 24, 5, 7, False, False),
     (4, 24, 6, 6, 12, False, False), (16, 10, 5, 20, 24, False, False),
     (4, 40, 10, 8, 8, True, False), (4, 24, 6, 6, 12, False, True),
     (4, 40, 10, 5, 8, False, False), (4, 40, 10, 1, 8, False, True)],
)  # fmt: skip
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op_st, min_size=20, max_size=60))
def test_random_operations_keep_invariants(
    page_size, num_pages, num_swa_pages, window, chunk, disable, free, ops
):
    sim = Sim(page_size, num_pages, num_swa_pages, window, chunk, disable, free)
    for op in ops:
        apply(sim, *op)
        check_all(sim)
    sim.drain()


def test_check_catches_swa_freed_behind_its_back():
    sim = Sim()
    put(sim, A[:8])
    sim.alloc.free_swa(sim.cache.match_prefix(A[:8]).indices[:1])
    with pytest.raises(AssertionError):
        sim.cache.check()


def test_evict_frees_swa_and_tombstone_leaves():
    sim = Sim()
    put(sim, A[:16])
    put(sim, A[:8] + [5] * 8)
    assert sim.cache.evict_swa(8) == 8
    assert sim.cache.evict(100) == 24
    assert sim.alloc.num_free_full_pages == sim.num_pages
    assert sim.alloc.swa.num_free_pages == sim.num_swa_pages
    assert sim.cache.swa_total_size() == 0
    check_all(sim)


def test_free_out_of_window_drops_what_the_request_no_longer_sees():
    sim = Sim(page_size=4, num_swa_pages=6, window=8, chunk=8, free=True)
    req = sim.admit(A)
    while not req.done:
        assert sim.step(req)
        check_all(sim)  # only the window is held, and a page more once the prompt is done
        assert sim.swa_used() == sim.window + (sim.page_size if req.done else 0)
    sim.release(req)
    again = sim.admit(A)  # the page kept past the window still gives the whole-prompt hit
    assert again.cached_tokens == 60
    sim.release(again)
    sim.drain()
