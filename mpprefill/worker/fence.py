"""KVWriteFence: KV pages are read (sent, staged to the host) only once written.

The scheduler notes, at every submit, which pages the forward writes. A reader asks for
the generation its pages need (`required`, on the scheduler thread, when the read is
decided) and waits for it (`wait`, on whatever thread reads) before touching them. An
early send of a cached prefix whose last chunk is still being computed therefore waits
for that forward; pages written long ago pass at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVWriteFence:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        written: Callable[[int], None],
        query: Callable[[int], bool],
    ):
        """`written(seq)` blocks until forward `seq` (and every earlier one) finished
        its KV writes; `query(seq)` asks without blocking."""
        self.page_size = page_size
        self.writer = torch.zeros(num_pages, dtype=torch.int64)  # last forward per page
        self._written, self._query = written, query

    def note_writes(self, seq: int, out_cache_loc: torch.Tensor) -> None:
        """Forward `seq` writes the KV slots `out_cache_loc` (scheduler thread, at submit)."""
        if len(out_cache_loc):
            pages = out_cache_loc.to("cpu", torch.int64) // self.page_size
            self.writer.index_fill_(0, pages, seq)

    def required(self, pages: torch.Tensor) -> int:
        """The forward generation whose completion makes `pages` safe to read."""
        if not len(pages):
            return 0
        return int(self.writer.index_select(0, pages.to("cpu", torch.int64)).max())

    def wait(self, gen: int) -> None:
        if gen > 0:
            self._written(gen)

    def done(self, gen: int) -> bool:
        return gen <= 0 or self._query(gen)
