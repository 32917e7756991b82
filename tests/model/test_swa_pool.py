"""Sliding-window layers over their own, smaller KV pool: logits equal a dense sliding-window
reference while the pool frees pages that left the window."""

from __future__ import annotations

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from mpprefill.model import ForwardBatch, load_model
from mpprefill.model.loader import source_config
from mpprefill.model.swa import parse_swa_layers, with_sliding_window

WINDOW, PAGE, CHUNK = 16, 4, 24


def dense_logits(model, ids: list[int]) -> torch.Tensor:
    """One forward of the whole prompt over a dense pool (SWA slots = full slots)."""
    kv = KVCache.for_model(model.config, len(ids))
    return model(ForwardBatch.build([ids], [0], [list(range(len(ids)))]), kv)[0]


def test_kv_cache_keeps_swa_layers_in_their_own_pool():
    model = load_model(None, sliding_window=WINDOW, swa_layers="sf")
    kv = KVCache.for_model(model.config, 64, num_swa_slots=16)
    assert kv.swa_layers == (0, 2) and kv.full_layers == (1, 3)
    assert kv.buffer.shape[1:3] == (2, 64) and kv.swa_buffer.shape[1:3] == (2, 16)
    assert kv.storage.dim() == 1 and kv.num_layers == 4 and kv.num_swa_slots == 16
    assert kv.storage.numel() == kv.buffer.numel() + kv.swa_buffer.numel()
    k = torch.ones(1, *kv.k(0).shape[1:])
    kv.write(2, torch.tensor([15]), k, 2 * k)
    assert float(kv.swa_buffer[0, 1, 15].sum()) == k.numel()  # SWA pool, second SWA layer
    assert float(kv.buffer.abs().sum()) == 0
    shape = KVCache.model_storage_shape(model.config, 64, 16)
    assert shape == (kv.storage.numel(),)
    KVCache.for_model(model.config, 64, buffer=torch.zeros(shape), num_swa_slots=16)
    with pytest.raises(ValueError, match="expected"):
        KVCache.for_model(model.config, 64, buffer=torch.zeros(shape), num_swa_slots=8)


def test_chunked_prefill_over_a_small_swa_pool_matches_dense():
    model = load_model(None, sliding_window=WINDOW, swa_layers="sf")
    prompt = torch.randint(
        0, model.config.vocab_size, (100,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    swa_pages = cdiv(WINDOW, PAGE) + cdiv(CHUNK, PAGE) + 1  # the least a chunk can run in
    alloc = SwaPagedAllocator(num_pages=64, page_size=PAGE, num_swa_pages=swa_pages)
    kv = KVCache.for_model(model.config, 64 * PAGE, num_swa_slots=swa_pages * PAGE)
    row, freed_to, peak = torch.empty(0, dtype=torch.int64), 0, 0
    for start in range(0, len(prompt), CHUNK):
        end = min(start + CHUNK, len(prompt))
        last = int(row[-1]) if start else -1
        out = alloc.alloc_extend([start], [end], [last])
        assert out is not None, f"chunk at {start} found no pages"
        row = torch.cat([row, out])
        peak = max(peak, swa_pages - alloc.swa.num_free_pages)
        fb = ForwardBatch.build([prompt[start:end]], [start], [row.tolist()])
        fb.swa_out_cache_loc = alloc.translate(fb.out_cache_loc)
        fb.swa_kv_indices = alloc.translate(fb.kv_indices, missing=-1)
        torch.testing.assert_close(model(fb, kv)[0], dense_logits(model, prompt[:end]))
        # positions <= end - WINDOW are out of every later query's window
        dead = (end - WINDOW + 1) // PAGE * PAGE
        if dead > freed_to:
            alloc.free_swa(row[freed_to:dead])
            freed_to = dead
        alloc.check()
    assert freed_to > 0 and peak <= swa_pages < cdiv(len(prompt), PAGE)


def test_a_key_inside_the_window_without_swa_slot_is_an_error():
    model = load_model(None, sliding_window=WINDOW, swa_layers="all")
    alloc = SwaPagedAllocator(num_pages=16, page_size=PAGE, num_swa_pages=16)
    kv = KVCache.for_model(model.config, 16 * PAGE, num_swa_slots=16 * PAGE)
    slots = alloc.alloc(32)
    alloc.free_swa(slots[24:28])  # positions 24..27: inside the window of position 32
    tail = alloc.alloc(4)
    fb = ForwardBatch.build([[1, 2, 3, 4]], [32], [torch.cat([slots, tail]).tolist()])
    fb.swa_out_cache_loc = alloc.translate(fb.out_cache_loc)
    fb.swa_kv_indices = alloc.translate(fb.kv_indices, missing=-1)
    with pytest.raises(RuntimeError, match="no SWA slot"):
        fb.check_window_slots(WINDOW)
    fb.check_window_slots(4)  # a window of 4 reaches back to position 29 only
    with pytest.raises((RuntimeError, IndexError)):  # the forward itself reads no slot -1
        model(fb, kv)


def test_layer_patterns():
    assert parse_swa_layers("all", 3) == ("sliding_attention",) * 3
    assert parse_swa_layers("ssf", 4) == (
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    )
    assert parse_swa_layers("1, 3", 4)[1::2] == ("sliding_attention",) * 2
    for bad, msg in [("9", "the model has 4"), ("x", "which layers slide"), (",", "names no")]:
        with pytest.raises(ValueError, match=msg):
            parse_swa_layers(bad, 4)


def test_flags_override_the_model_config():
    base = load_model(None).config
    assert not base.has_sliding_layers
    assert with_sliding_window(base) is base
    cfg = with_sliding_window(base, 32)
    assert cfg.sliding_window == 32 and all(cfg.is_sliding(i) for i in range(4))
    assert with_sliding_window(cfg, 8).layer_types == cfg.layer_types  # keeps its layers
    with pytest.raises(ValueError, match="needs --sliding-window"):
        with_sliding_window(base, None, "sf")
    with pytest.raises(ValueError, match="--sliding-window must be positive"):
        ServerArgs(sliding_window=0)
    with pytest.raises(ValueError, match="swa-full-tokens-ratio"):
        ServerArgs(swa_full_tokens_ratio=0)
    args = ServerArgs(sliding_window=32, swa_layers="fs", max_total_tokens=1024)
    assert source_config(args.model_source()).layer_types[1] == "sliding_attention"
    assert args.pool_config().num_swa_pages == int(1024 // 16 * 0.8)
