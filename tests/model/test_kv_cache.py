from __future__ import annotations

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ModelConfig


def test_layout_and_sizes():
    kv = KVCache(num_layers=3, num_slots=10, num_kv_heads=2, head_dim=4)
    assert kv.buffer.shape == KVCache.shape(3, 10, 2, 4) == (2, 3, 10, 2, 4)
    assert kv.buffer.is_contiguous()
    assert (kv.num_layers, kv.num_slots) == (3, 10)
    assert kv.bytes_per_slot == 2 * 3 * 2 * 4 * 4
    assert kv.k(1).data_ptr() == kv.buffer[0, 1].data_ptr()


def test_write_then_gather_round_trips():
    kv = KVCache(2, 8, 2, 4)
    locs = torch.tensor([6, 1, 3])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    kv.write(1, locs, k, v)
    got = kv.gather(locs)
    assert got.shape == (2, 2, 3, 2, 4)
    torch.testing.assert_close(got[0, 1], k)
    torch.testing.assert_close(got[1, 1], v)
    assert not got[:, 0].any()
    assert not kv.gather(torch.tensor([0, 2])).any()


def test_preallocated_buffer_is_used_not_copied():
    buf = torch.zeros(KVCache.shape(2, 5, 1, 2), dtype=torch.float16)
    kv = KVCache(2, 5, 1, 2, dtype=torch.float16, buffer=buf)
    kv.write(0, torch.tensor([4]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert kv.buffer is buf and buf[0, 0, 4].eq(1).all()


@pytest.mark.parametrize(
    "buf",
    [torch.zeros(2, 2, 6, 1, 2), torch.zeros(2, 2, 5, 1, 2, dtype=torch.float64)],
)
def test_preallocated_buffer_must_match(buf):
    with pytest.raises(ValueError, match="expected"):
        KVCache(2, 5, 1, 2, buffer=buf)


def test_for_model_and_bad_dims():
    cfg = ModelConfig.tiny()
    kv = KVCache.for_model(cfg, 16)
    assert kv.buffer.shape == (2, cfg.num_hidden_layers, 16, cfg.num_key_value_heads, 32)
    with pytest.raises(ValueError, match="positive"):
        KVCache(2, 0, 1, 2)
