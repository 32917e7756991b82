"""SwaPagedAllocator: full-attention pages plus a smaller pool of sliding-window pages.

Every allocated page (a "full page": it identifies the token slots that req_to_token rows,
the radix cache and the full-attention layers use) is paired with a page of the SWA pool,
where the sliding-window layers keep their K and V. Once a page's tokens have fallen out
of the window of everything that may still read them, its SWA page is freed on its own
(`free_swa`) and the full page stays: the page is then a "tombstone" for the SWA layers.

    full page   0    1    2    3    4        swa_page_of = [5, -1, -1, 0, 2]
    SWA page    5    .    .    0    2        pages 1, 2: out of the window, SWA freed
"""

from __future__ import annotations

import torch
from torch import Tensor

from mpprefill.memory.allocator import PagedTokenAllocator


class SwaPagedAllocator(PagedTokenAllocator):
    """A PagedTokenAllocator whose pages also take an SWA page each; freeing a page frees
    its SWA page too (when it still has one)."""

    def __init__(self, num_pages: int, page_size: int, num_swa_pages: int) -> None:
        if num_swa_pages <= 0:
            raise ValueError(f"the SWA pool needs at least one page, got {num_swa_pages}")
        super().__init__(num_pages, page_size)
        self.swa = PagedTokenAllocator(num_swa_pages, page_size)
        self.swa_page_of = torch.full((num_pages,), -1, dtype=torch.int64)

    @property
    def num_free_pages(self) -> int:
        """Pages that can be allocated now: both pools must have one."""
        return min(self._num_free, self.swa.num_free_pages)

    @property
    def has_swa_pool(self) -> bool:
        return True

    @property
    def num_free_swa_pages(self) -> int:
        return self.swa.num_free_pages

    @property
    def swa_size(self) -> int:
        return self.swa.size

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def swa_slots(self, slots: Tensor, missing: int | None = None) -> Tensor:
        return self.translate(slots, missing)

    def alloc_pages(self, num_pages: int) -> Tensor | None:
        if num_pages > self.swa.num_free_pages:
            return None
        pages = super().alloc_pages(num_pages)
        if pages is None:
            return None
        self.swa_page_of[pages] = self.swa.alloc_pages(num_pages)
        return pages

    def free(self, slots: Tensor) -> None:
        if slots.numel():
            pages = torch.unique(slots // self.page_size)
            super().free(slots)  # NOTE: checks range and double frees before SWA is touched
            self._drop_swa(pages)

    def free_swa(self, slots: Tensor) -> int:
        """Free the SWA pages of these slots' pages that still have one; the full pages stay
        allocated. Returns the number of SWA tokens freed."""
        if slots.numel() == 0:
            return 0
        pages = torch.unique(slots // self.page_size)
        if not self.is_held(self.slots_of(pages)):
            raise ValueError("free_swa of a page that is not allocated")
        return self._drop_swa(pages) * self.page_size

    def move_swa(self, src: Tensor, dst: Tensor) -> None:
        """dst's pages take over src's SWA pages (the same tokens at the same positions,
        so the same KV); src's pages are left without one. Whole pages, pairwise."""
        ps = self.page_size
        src_pages, dst_pages = src[::ps] // ps, dst[::ps] // ps
        if len(src_pages) != len(dst_pages) or not bool((self.swa_page_of[dst_pages] < 0).all()):
            raise ValueError("move_swa: page counts differ or a target still has an SWA page")
        self.swa_page_of[dst_pages] = self.swa_page_of[src_pages]
        self.swa_page_of[src_pages] = -1

    def has_swa(self, slots: Tensor) -> Tensor:
        """Per slot: does its page still hold SWA KV?"""
        return self.swa_page_of[slots // self.page_size] >= 0

    def translate(self, slots: Tensor, missing: int | None = None) -> Tensor:
        """SWA-pool slots of full slots. A slot whose page has no SWA page raises, or maps to
        `missing` when one is given (the model never reads those: they are out of window)."""
        swa_pages = self.swa_page_of[slots // self.page_size]
        out = swa_pages * self.page_size + slots % self.page_size
        gone = swa_pages < 0
        if bool(gone.any()):
            if missing is None:
                raise ValueError(f"{int(gone.sum())} slots have no SWA page")
            out[gone] = missing
        return out

    def _drop_swa(self, pages: Tensor) -> int:
        swa_pages = self.swa_page_of[pages]
        have = swa_pages >= 0
        if bool(have.any()):
            self.swa.free(self.swa.slots_of(swa_pages[have]))
        self.swa_page_of[pages] = -1
        return int(have.sum())

    def check(self) -> None:
        super().check()
        self.swa.check()
        mapped = self.swa_page_of[self.swa_page_of >= 0]
        held = self.swa.num_pages - self.swa.num_free_pages
        assert len(mapped) == held, f"SWA pages: {len(mapped)} mapped, {held} allocated"
        assert len(torch.unique(mapped)) == len(mapped), "an SWA page backs two pages"
        owners = (self.swa_page_of >= 0).nonzero().flatten()
        assert self.is_held(self.slots_of(owners)), "a free page still holds an SWA page"

    def __repr__(self) -> str:
        return (
            f"SwaPagedAllocator(free={self._num_free}/{self.num_pages} pages, "
            f"swa free={self.swa.num_free_pages}/{self.swa.num_pages}, "
            f"page_size={self.page_size})"
        )
