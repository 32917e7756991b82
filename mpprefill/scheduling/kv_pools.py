"""The scheduler's KV bookkeeping: allocator and radix cache, with or without an SWA pool.

For models with sliding-window layers the allocator pairs each page with a page of the
smaller SWA pool (`SwaPagedAllocator`) and the cache tracks the two holdings apart
(`SwaRadixCache`); these helpers keep that difference out of the scheduler's code.
"""

from __future__ import annotations

from mpprefill.layer_configs import PoolConfig
from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.radix_cache import RadixCache
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.model import ForwardBatch, ModelConfig


def make_kv_pools(
    pools: PoolConfig, config: ModelConfig, req_pool: ReqToTokenPool
) -> tuple[PagedTokenAllocator, RadixCache]:
    if not config.has_sliding_layers:
        allocator = PagedTokenAllocator(pools.num_pages, pools.page_size)
        return allocator, RadixCache(
            req_pool, allocator, pools.page_size, pools.disable_radix_cache
        )
    from mpprefill.memory.swa_allocator import SwaPagedAllocator
    from mpprefill.memory.swa_radix_cache import SwaRadixCache

    check_swa_args(pools, config)
    allocator = SwaPagedAllocator(pools.num_pages, pools.page_size, pools.num_swa_pages)
    tree = SwaRadixCache(
        req_pool,
        allocator,
        pools.page_size,
        config.sliding_window,
        disable=pools.disable_radix_cache,
        free_out_of_window=pools.swa_free_out_of_window,
    )
    return allocator, tree


def check_swa_args(pools: PoolConfig, config: ModelConfig) -> None:
    """Refuse, at start-up, settings under which a sliding-window model cannot run."""
    ps, window = pools.page_size, config.sliding_window
    chunk = pools.chunked_prefill_size
    if chunk != -1:
        # a chunk's pages plus the window it attends to, a partial page each side, and the
        # page a finished prompt keeps beyond its window (SwaRadixCache)
        need = cdiv(chunk, ps) + cdiv(window, ps) + 3
        if need > pools.num_swa_pages:
            raise ValueError(
                f"the SWA pool ({pools.num_swa_pages} pages of {ps}) cannot hold a chunk of "
                f"{chunk} tokens and a window of {window} ({need} pages); raise "
                "--swa-full-tokens-ratio or --max-total-tokens"
            )


def prompt_fits(allocator: PagedTokenAllocator, prompt_len: int, chunked: bool) -> str | None:
    """Why a prompt can never get its KV pages (None when it can)."""
    need = allocator.pages_needed(0, prompt_len)
    if need > allocator.num_pages:
        return f"prompt of {prompt_len} tokens exceeds the KV pool ({allocator.size} tokens)"
    swa_tokens = allocator.swa_size
    if allocator.has_swa_pool and not chunked and need * allocator.page_size > swa_tokens:
        return f"prompt of {prompt_len} tokens exceeds the SWA KV pool ({swa_tokens} tokens)"
    return None


def reclaimable_pages(tree: RadixCache, allocator: PagedTokenAllocator) -> int:
    """Pages an allocation could get now, evicting from the cache as needed."""
    ps = allocator.page_size
    free = allocator.num_free_full_pages + tree.evictable_size() // ps
    if not allocator.has_swa_pool:
        return free
    return min(free, allocator.num_free_swa_pages + tree.swa_evictable_size() // ps)


def reclaim(tree: RadixCache, allocator: PagedTokenAllocator, need: int) -> None:
    """Evict from the cache until `need` pages can be allocated (as far as it can)."""
    ps = allocator.page_size
    if allocator.has_swa_pool and need > allocator.num_free_swa_pages:
        # SWA only: the full KV stays
        tree.evict_swa((need - allocator.num_free_swa_pages) * ps)
    if need > allocator.num_free_pages:
        tree.evict((need - allocator.num_free_pages) * ps)


def add_swa_slots(
    allocator: PagedTokenAllocator, fb: ForwardBatch, check_window: int | None = None
) -> None:
    """Fill a batch's SWA-pool slots (-1 for keys whose SWA page left with the window);
    without an SWA pool they stay empty. With `check_window`, raise unless every key
    inside that window has its slot."""
    fb.swa_out_cache_loc = allocator.swa_slots(fb.out_cache_loc)
    fb.swa_kv_indices = allocator.swa_slots(fb.kv_indices, missing=-1)
    if check_window is not None:
        fb.check_window_slots(check_window)


def kv_stats(allocator: PagedTokenAllocator, tree: RadixCache) -> dict[str, object]:
    """Pool occupancy; with sliding-window layers, their pool's too."""
    kv: dict[str, object] = {
        "free_tokens": allocator.available_size(),
        "total_tokens": allocator.size,
        "cached_tokens": tree.total_size(),
    }
    if allocator.has_swa_pool:
        kv["swa"] = {
            "free_tokens": allocator.swa_available_size(),
            "total_tokens": allocator.swa_size,
            "cached_tokens": tree.swa_total_size(),
        }
    return kv
