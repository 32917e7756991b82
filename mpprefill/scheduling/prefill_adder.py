"""PrefillAdder: decides which waiting requests (and how much of each) join a batch."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.radix_cache import MatchResult, RadixCache
from mpprefill.scheduling.kv_pools import reclaimable_pages
from mpprefill.scheduling.req import Req

if TYPE_CHECKING:
    from mpprefill.scheduling.host_tier import HostTier


class AddResult(enum.Enum):
    ADDED = "added"
    DEFER = "defer"  # skip for now, keep scanning
    FULL = "full"  # stop admitting


class PrefillAdder:
    """Admits by budget: chunk size, max prefill tokens, running requests, free KV.

    Budgets shrink as requests are added. At most one request is chunked per batch:
    once a request is cut, admission stops.

        extend of one request (page_size 4, chunk budget 6, prefix 8):
        prompt  | 0 .. 7 prefix | 8 9 10 11 | 12 13 | 14 ... |
        chunk     end = (8 + 6) // 4 * 4 = 12 -> take [8, 12), request stays chunked
    """

    def __init__(
        self,
        tree: RadixCache,
        allocator: PagedTokenAllocator,
        page_size: int,
        max_prefill_tokens: int,
        chunk_size: int | None,
        max_reqs: int,
        free_rows: int,
        pending_keys: dict[tuple, int],
        host: HostTier | None,
    ):
        self.tree, self.allocator, self.page_size = tree, allocator, page_size
        self.host = host
        self.pending_keys = pending_keys
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunk_size  # None: no chunking
        self.rem_reqs = min(max_reqs, free_rows)
        self.reserved_pages = 0
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_pages(self) -> int:
        free = reclaimable_pages(self.tree, self.allocator)
        return free - self.reserved_pages

    @property
    def full(self) -> bool:
        return (
            self.new_chunked_req is not None
            or self.rem_reqs <= 0
            or self.rem_input <= 0
            or (self.rem_chunk is not None and self.rem_chunk <= 0)
        )

    def add_chunked_req(self, req: Req) -> None:
        """Schedule the next chunk of the request that was cut in the previous batch."""
        self._take(req, self._extend_len(req))

    def add_one_req(self, req: Req) -> AddResult:
        """Match, lock and admit `req` if it fits.

        DEFER: its next uncached page is being computed for another request right now, so
        it waits to hit the cache instead of computing the same KV twice.
        """
        if self.full:
            return AddResult.FULL
        match, left_on_host = self._match(req)
        if left_on_host:
            return AddResult.FULL  # its host pages load when there is room for them
        prefix = match.indices[: self._max_prefix(req)]
        key = self._prefix_key(req, len(prefix))
        if key is not None and self.pending_keys.get(key, 0) > 0:
            return AddResult.DEFER
        self.tree.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = prefix, match.last_node
        req.cache_protected_len = len(prefix)
        n = self._extend_len(req)
        if n <= 0:
            self.tree.dec_lock_ref(match.last_node)
            req.prefix_indices, req.last_node, req.cache_protected_len = prefix[:0], None, 0
            return AddResult.FULL
        req.cached_tokens = len(prefix)
        if key is not None:
            req.prefix_key = key
            self.pending_keys[key] = self.pending_keys.get(key, 0) + 1
        self._take(req, n)
        return AddResult.ADDED

    def _match(self, req: Req) -> tuple[MatchResult, int]:
        """The cached prefix and how many of its host pages could not be loaded.

        With a host tier, host pages past the device match are loaded within the device
        pages left after this request's first chunk, and count as cached. Only a request
        that runs first may load part of them.
        """
        if self.host is None:
            # NOTE: matched up to the longest prefix it may use, so that the node it locks
            # ends there (with sliding-window layers, that prefix's window must be cached)
            return self.tree.match_prefix(req.origin_input_ids[: self._max_prefix(req)]), 0
        limit = self._max_prefix(req)
        tail = self.allocator.pages_needed(limit, req.prompt_len)  # unchunked: all of it
        tail = 1 if self.rem_chunk is not None else tail
        budget = lambda: self.rem_pages - tail
        return self.host.match_prefix(req.origin_input_ids, limit, budget, not self.can_run)

    def _prefix_key(self, req: Req, prefix_len: int) -> tuple | None:
        """(offset, tokens) of the first uncached page, when a whole page is uncached."""
        page = req.origin_input_ids[prefix_len : prefix_len + self.page_size]
        if self.tree.disable:
            return None  # nothing to wait for: no request will hit it
        if len(page) < self.page_size or prefix_len + self.page_size >= req.prompt_len:
            return None
        return (prefix_len, tuple(page))

    def _max_prefix(self, req: Req) -> int:
        # At least one token must be computed to produce logits for the first token.
        last = req.prompt_len - 1
        return last - last % self.page_size

    def _extend_len(self, req: Req) -> int:
        """New tokens `req` may take now, or 0 if it must wait."""
        prefix, want = req.prefix_len, req.prompt_len - req.prefix_len
        # A request larger than the input budget may still run alone.
        budget = min(want, self.rem_input) if self.can_run else want
        if self.rem_chunk is not None:
            budget = min(budget, self.rem_chunk)
        ps = self.page_size
        max_end = (cdiv(prefix, ps) + self.rem_pages) * ps  # last slot the free pages reach
        budget = min(budget, max_end - prefix)
        if budget < want:
            if self.rem_chunk is None:
                return 0  # unchunked requests go whole or not at all
            budget = (prefix + budget) // ps * ps - prefix  # a cut ends on a page boundary
        return max(budget, 0)

    def _take(self, req: Req, n: int) -> None:
        if n <= 0:
            return
        req.fill_ids = req.origin_input_ids[: req.prefix_len + n]
        req.is_chunked = not req.is_last_chunk()
        self.reserved_pages += self.allocator.pages_needed(req.prefix_len, req.prefix_len + n)
        self.rem_input -= n
        if self.rem_chunk is not None:
            self.rem_chunk -= n
        self.rem_reqs -= 1
        self.can_run.append(req)
        if req.is_chunked:
            self.new_chunked_req = req
