from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.memory.allocator import PagedTokenAllocator


def pages_of(slots: torch.Tensor, page_size: int) -> set[int]:
    return set((slots // page_size).tolist())


@pytest.mark.parametrize(
    ("prefix", "seq", "pages"),
    [(0, 0, 0), (0, 1, 1), (0, 16, 1), (0, 33, 3), (16, 17, 1), (17, 32, 0), (17, 33, 1)],
)
def test_pages_needed_rounds_up(prefix, seq, pages):
    assert PagedTokenAllocator(8, 16).pages_needed(prefix, seq) == pages


def test_33_token_prompt_holds_3_pages():
    alloc = PagedTokenAllocator(8, 16)
    slots = alloc.alloc_extend([0], [33], [-1])
    assert len(slots) == 33
    assert len(pages_of(slots, 16)) == 3
    assert alloc.num_free_pages == 5 and alloc.available_size() == 80
    assert (slots % 16 == torch.arange(33) % 16).all()
    alloc.check()


def test_plain_allocator_has_no_swa_pool():
    alloc = PagedTokenAllocator(8, 16)
    alloc.alloc(32)
    assert not alloc.has_swa_pool and alloc.num_free_full_pages == alloc.num_free_pages == 6
    assert alloc.num_free_swa_pages == alloc.swa_size == alloc.swa_available_size() == 0
    assert alloc.swa_slots(torch.arange(4), missing=-1).numel() == 0


def test_extend_continues_partial_page():
    alloc = PagedTokenAllocator(8, 16)
    first = alloc.alloc_extend([0], [20], [-1])
    second = alloc.alloc_extend([20], [40], [int(first[-1])])
    assert second[:12].tolist() == list(range(int(first[-1]) + 1, int(first[-1]) + 13))
    assert len(second) == 20 and alloc.num_free_pages == 8 - 3
    row = torch.cat([first, second])
    assert (row % 16 == torch.arange(40) % 16).all()
    inside = alloc.alloc_extend([40], [43], [int(second[-1])])
    assert inside.tolist() == [int(second[-1]) + k for k in (1, 2, 3)]
    assert alloc.num_free_pages == 5
    alloc.check()


def test_extend_many_requests_in_order():
    alloc = PagedTokenAllocator(16, 4)
    a = alloc.alloc_extend([0], [6], [-1])
    out = alloc.alloc_extend([6, 0, 8], [9, 5, 8], [int(a[-1]), -1, 123])
    assert len(out) == 3 + 5 + 0
    assert out[:2].tolist() == [int(a[-1]) + 1, int(a[-1]) + 2]
    assert alloc.num_free_pages == 16 - 2 - 1 - 2
    alloc.check()


def test_bad_last_loc_raises_and_allocates_nothing():
    alloc = PagedTokenAllocator(8, 4)
    a = alloc.alloc_extend([0], [6], [-1])
    with pytest.raises(ValueError):
        alloc.alloc_extend([0, 6], [4, 8], [-1, int(a[-1]) + 1])  # wrong offset in page
    with pytest.raises(ValueError):
        alloc.alloc_extend([6], [8], [29])  # page 7 is free
    assert alloc.num_free_pages == 6
    alloc.check()


def test_free_by_page_and_double_free_raises():
    alloc = PagedTokenAllocator(4, 16)
    slots = alloc.alloc_extend([0], [40], [-1])
    alloc.free(slots[17:18])  # one slot frees its whole page
    assert alloc.num_free_pages == 2
    with pytest.raises(ValueError):
        alloc.free(slots[16:32])
    alloc.free(torch.cat([slots[:16], slots[32:]]))
    assert alloc.num_free_pages == 4
    with pytest.raises(ValueError):
        alloc.free(slots[:1])
    with pytest.raises(IndexError):
        alloc.free(torch.tensor([64]))
    alloc.check()


def test_out_of_memory_returns_none_without_partial_alloc():
    alloc = PagedTokenAllocator(4, 16)
    assert alloc.alloc_extend([0, 0], [40, 40], [-1, -1]) is None
    assert alloc.alloc_pages(5) is None and alloc.alloc(80) is None
    assert alloc.num_free_pages == 4
    assert alloc.alloc_extend([0], [64], [-1]) is not None
    assert alloc.alloc_extend([0], [1], [-1]) is None
    alloc.check()


def test_alloc_whole_pages_lowest_first():
    alloc = PagedTokenAllocator(4, 8)
    assert alloc.alloc(16).tolist() == list(range(16))
    with pytest.raises(ValueError):
        alloc.alloc(10)
    alloc.free(torch.tensor([0]))
    assert alloc.alloc_pages(2).tolist() == [2, 3]
    assert alloc.alloc_pages(1).tolist() == [0]  # released pages come back once needed
    alloc.check()


def test_page_size_one():
    alloc = PagedTokenAllocator(10, 1)
    a = alloc.alloc_extend([0], [3], [-1])
    b = alloc.alloc_extend([3], [5], [int(a[-1])])
    assert len(torch.unique(torch.cat([a, b]))) == 5 and alloc.available_size() == 5
    alloc.free(a[1:2])
    assert alloc.available_size() == 6
    alloc.check()


ops = st.lists(
    st.tuples(st.sampled_from(["new", "extend", "free"]), st.integers(0, 50), st.integers(0, 7)),
    max_size=40,
)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_holders_and_free_list_partition_pages(page_size, ops):
    alloc = PagedTokenAllocator(64 // page_size + 3, page_size)
    holders: list[torch.Tensor] = []
    for op, n, pick in ops:
        if op == "new":
            slots = alloc.alloc_extend([0], [n], [-1])
            if slots is not None:
                holders.append(slots)
        elif op == "extend" and holders:
            i = pick % len(holders)
            held = holders[i]
            last = int(held[-1]) if len(held) else -1
            new = alloc.alloc_extend([len(held)], [len(held) + n], [last])
            if new is not None:
                holders[i] = torch.cat([held, new])
        elif op == "free" and holders:
            alloc.free(holders.pop(pick % len(holders)))
        check_partition(alloc, holders)


def check_partition(alloc: PagedTokenAllocator, holders: list[torch.Tensor]) -> None:
    alloc.check()
    ps = alloc.page_size
    owned: list[int] = []
    for slots in holders:
        assert (slots % ps == torch.arange(len(slots)) % ps).all()
        owned.extend(pages_of(slots, ps))
    free = alloc.free_pages().tolist()
    assert len(owned) == len(set(owned)), "a page has two holders"
    assert sorted(owned + free) == list(range(alloc.num_pages))
