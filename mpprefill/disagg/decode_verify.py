"""The decode receiver's `--verify`: recompute a prompt's KV densely and compare."""

from __future__ import annotations

import torch

from mpprefill.memory.allocator import cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch


def reference_kv(model, input_ids: list[int], page_size: int) -> torch.Tensor:
    """KV of one dense prefill of the whole prompt: [2, L, len(input_ids), H, D]."""
    n = len(input_ids)
    kv = KVCache.for_model(model.config, cdiv(n, page_size) * page_size)
    model(ForwardBatch.build([input_ids], [0], [list(range(n))]), kv)
    return kv.buffer[:, :, :n]


def compare_kv(
    model, input_ids: list[int], page_size: int, prefix_len: int, received: torch.Tensor
) -> tuple[bool, float]:
    """(close enough, max abs error) of received KV [2, L, n, H, D] past `prefix_len`."""
    expected = reference_kv(model, input_ids, page_size)
    got, want = received[:, :, prefix_len:].float(), expected[:, :, prefix_len:].float()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    atol = 1e-4 if expected.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got, want, rtol=atol, atol=atol)), err
