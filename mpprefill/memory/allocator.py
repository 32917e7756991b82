"""PagedTokenAllocator: hands out KV slots a whole page at a time."""

from __future__ import annotations

import torch
from torch import Tensor


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedTokenAllocator:
    """Free list of KV pages; page p owns slots [p * page_size, (p + 1) * page_size).

    Token `pos` of a request always sits at offset `pos % page_size` of its page, so a
    request's last page may be partially filled and is continued by the next extend.
    Pages are handed out lowest first; freed pages wait in a release list that is merged
    (sorted) into the free list only when the free list runs short.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"bad allocator shape: {num_pages} pages of {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self._released: list[Tensor] = []
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)
        self._num_free = self.num_pages

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_free_full_pages(self) -> int:
        return self._num_free

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return self._num_free * self.page_size

    # ---- the sliding-window pool: none here (SwaPagedAllocator has one) -------------------

    @property
    def has_swa_pool(self) -> bool:
        return False

    @property
    def num_free_swa_pages(self) -> int:
        return 0

    @property
    def swa_size(self) -> int:
        """Capacity of the SWA pool in tokens."""
        return 0

    def swa_available_size(self) -> int:
        return 0

    def swa_slots(self, slots: Tensor, missing: int | None = None) -> Tensor:
        """SWA-pool slots of full slots; empty here, which a ForwardBatch reads as "the SWA
        layers use the full slots"."""
        return torch.empty(0, dtype=torch.int64)

    def pages_needed(self, prefix_len: int, seq_len: int) -> int:
        """New pages for extending a request from prefix_len to seq_len tokens.

        page_size 4, prefix_len 6, seq_len 13 (p: prefix token, e: extend token):

            position  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 . . .
            token     p p p p | p p e e | e e e  e  | e
            page      held    | held    | new       | new

        The extend first fills the held partial page (positions 6, 7), then takes
        ceil(13 / 4) - ceil(6 / 4) = 4 - 2 = 2 new pages; a non-full tail page is a page.
        """
        if not 0 <= prefix_len <= seq_len:
            raise ValueError(f"bad extend: prefix_len {prefix_len}, seq_len {seq_len}")
        return cdiv(seq_len, self.page_size) - cdiv(prefix_len, self.page_size)

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        """Page ids, or None (allocating nothing) when fewer are free."""
        if num_pages < 0:
            raise ValueError(f"negative page count {num_pages}")
        if num_pages > self._num_free:
            return None
        if num_pages > len(self._free_pages):
            self._merge_released()
        pages, self._free_pages = self._free_pages[:num_pages], self._free_pages[num_pages:]
        self._is_free[pages] = False
        self._num_free -= num_pages
        return pages

    def alloc(self, num_tokens: int) -> Tensor | None:
        """Slots of num_tokens / page_size whole pages; num_tokens must be page-aligned."""
        if num_tokens % self.page_size:
            raise ValueError(f"alloc({num_tokens}) is not a multiple of page {self.page_size}")
        pages = self.alloc_pages(num_tokens // self.page_size)
        return None if pages is None else self.slots_of(pages)

    def alloc_extend(
        self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]
    ) -> Tensor | None:
        """Slots for positions [prefix_len, seq_len) of each request, concatenated in order.

        last_locs[i] is the slot of request i's last prefix token (-1 when prefix_len is 0);
        its page is continued first. None (allocating nothing) when pages run short.
        """
        counts = [self.pages_needed(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]
        for p, last in zip(prefix_lens, last_locs, strict=True):
            self._check_last_loc(p, last)
        pages = self.alloc_pages(sum(counts))
        if pages is None:
            return None
        parts, start = [], 0
        for p, s, last, k in zip(prefix_lens, seq_lens, last_locs, counts, strict=True):
            parts.append(self._extend_one(p, s, last, pages[start : start + k]))
            start += k
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def free(self, slots: Tensor) -> None:
        """Free every page that any of these slots belongs to."""
        if slots.numel() == 0:
            return
        self.release_pages(torch.unique(slots // self.page_size))

    def release_pages(self, pages: Tensor) -> None:
        """Free these pages: ids sorted, each once (as `torch.unique` gives them)."""
        if pages.numel() == 0:
            return
        if pages[0] < 0 or pages[-1] >= self.num_pages:
            raise IndexError(f"slot out of range: pages {pages[0]}..{pages[-1]}")
        if self._is_free[pages].any():
            raise ValueError(f"double free of pages {pages[self._is_free[pages]].tolist()}")
        self._is_free[pages] = True
        self._released.append(pages)
        self._num_free += len(pages)

    def is_held(self, slots: Tensor) -> bool:
        """True when every slot's page is allocated."""
        return slots.numel() == 0 or not self._is_free[slots // self.page_size].any()

    def free_pages(self) -> Tensor:
        """Sorted ids of all free pages (a copy)."""
        return torch.cat([self._free_pages, *self._released]).sort().values

    def slots_of(self, pages: Tensor) -> Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def check(self) -> None:
        free = self.free_pages()
        assert len(free) == self._num_free, "allocator: free count drifted"
        assert len(torch.unique(free)) == len(free), "allocator: a page is free twice"
        assert int(self._is_free.sum()) == self._num_free, "allocator: free mask drifted"
        assert bool(self._is_free[free].all()), "allocator: free list holds a held page"

    def _merge_released(self) -> None:
        self._free_pages = self.free_pages()
        self._released = []

    def _check_last_loc(self, prefix_len: int, last_loc: int) -> None:
        if prefix_len % self.page_size == 0:
            return
        in_range = 0 <= last_loc < self.size
        if not in_range or last_loc % self.page_size != (prefix_len - 1) % self.page_size:
            raise ValueError(f"last_loc {last_loc} cannot hold position {prefix_len - 1}")
        if self._is_free[last_loc // self.page_size]:
            raise ValueError(f"last_loc {last_loc} is in a free page")

    def _extend_one(self, prefix_len: int, seq_len: int, last_loc: int, pages: Tensor) -> Tensor:
        n = seq_len - prefix_len
        head = min(-prefix_len % self.page_size, n)
        head_slots = torch.arange(last_loc + 1, last_loc + 1 + head, dtype=torch.int64)
        return torch.cat([head_slots, self.slots_of(pages)[: n - head]])

    def __repr__(self) -> str:
        return (
            f"PagedTokenAllocator(free={self._num_free}/{self.num_pages} pages, "
            f"page_size={self.page_size})"
        )
