from __future__ import annotations

import pytest
import torch

from mpprefill.memory.swa_allocator import SwaPagedAllocator


def test_pages_come_with_swa_pages_and_free_together():
    a = SwaPagedAllocator(num_pages=8, page_size=4, num_swa_pages=3)
    slots = a.alloc(12)
    assert slots is not None and a.num_free_pages == 0  # the SWA pool is the short one
    assert a.num_free_full_pages == 5 and a.swa_available_size() == 0
    swa = a.translate(slots)
    assert sorted(set((swa // 4).tolist())) == [0, 1, 2]
    assert torch.equal(swa % 4, slots % 4)  # offsets inside a page are kept
    assert a.alloc(4) is None  # no SWA page left, although full pages are
    a.free(slots)
    a.check()
    assert a.num_free_pages == 3 and a.num_free_full_pages == 8


def test_free_swa_keeps_the_full_page():
    a = SwaPagedAllocator(num_pages=8, page_size=4, num_swa_pages=4)
    slots = a.alloc(16)
    assert a.free_swa(slots[:6]) == 8  # pages 0 and 1 (slot 5 is on page 1)
    assert a.has_swa(slots).tolist() == [False] * 8 + [True] * 8
    assert a.is_held(slots) and a.swa_available_size() == 8
    assert torch.equal(a.translate(slots[:8], missing=-1), torch.full((8,), -1))
    with pytest.raises(ValueError, match="no SWA page"):
        a.translate(slots[:1])
    assert a.free_swa(slots[:4]) == 0  # already gone: nothing to free twice
    a.check()
    a.free(slots)  # tombstoned pages free cleanly too
    a.check()
    assert a.num_free_full_pages == 8 and a.swa_available_size() == 16


def test_bad_frees_are_refused_without_side_effects():
    a = SwaPagedAllocator(num_pages=4, page_size=2, num_swa_pages=4)
    slots = a.alloc(4)
    a.free(slots[:2])
    with pytest.raises(ValueError, match="double free"):
        a.free(slots[:2])
    with pytest.raises(ValueError, match="not allocated"):
        a.free_swa(slots[:2])
    a.check()
    assert a.swa_available_size() == 6


def test_alloc_extend_continues_the_partial_page_in_both_pools():
    a = SwaPagedAllocator(num_pages=8, page_size=4, num_swa_pages=8)
    first = a.alloc_extend([0], [6], [-1])
    more = a.alloc_extend([6], [9], [int(first[-1])])
    slots = torch.cat([first, more])
    assert (slots[:8] // 4).unique().numel() == 2
    swa = a.translate(slots)
    assert torch.equal(swa[6:8] // 4, swa[4:6] // 4)  # same SWA page as the full page's
    a.check()


def test_swa_pool_answers_for_the_scheduler():
    a = SwaPagedAllocator(num_pages=4, page_size=2, num_swa_pages=2)
    assert a.has_swa_pool and a.swa_size == 4
    assert a.num_free_pages == 2 and a.num_free_full_pages == 4 and a.num_free_swa_pages == 2
    slots = a.alloc(2)
    assert a.num_free_swa_pages == 1 and a.swa_available_size() == 2
    assert torch.equal(a.swa_slots(slots), a.translate(slots))
    a.free_swa(slots)
    assert a.swa_slots(slots, missing=-1).tolist() == [-1, -1]
