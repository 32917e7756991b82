"""The batched attention backends against attention computed one request at a time."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mpprefill.model import ForwardBatch
from mpprefill.model.attention import (
    MAX_PADDING,
    TorchNative,
    TorchVarlen,
    group_requests,
    make_backend,
)

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 512


def reference(q, k_pool, v_pool, fb: ForwardBatch, window: int | None):
    """Request by request: its queries over its keys, masked as the module doc says."""
    out = torch.empty_like(q)
    row = key = 0
    for p, e in zip(fb.prefix_lens.tolist(), fb.extend_lens.tolist()):
        slots = fb.kv_indices[key : key + p + e]
        keys = torch.arange(p + e)
        queries = torch.arange(p, p + e)[:, None]
        sees = keys[None, :] <= queries
        if window is not None:
            sees &= keys[None, :] > queries - window
        qr, kr, vr = (t.transpose(0, 1) for t in (q[row : row + e], k_pool[slots], v_pool[slots]))
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=sees, enable_gqa=True)
        out[row : row + e] = o.transpose(0, 1)
        row, key = row + e, key + p + e
    return out


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa):
    """What torch's flash varlen kernel computes, one sequence at a time: the causal
    diagonal aligned to the end of each sequence's keys, `window_size[0]` keys to the left."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and enable_gqa
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        (qs, qe), (ks, ke) = cu_q[i : i + 2].tolist(), cu_k[i : i + 2].tolist()
        shift = (ke - ks) - (qe - qs)
        rows = torch.arange(qe - qs)[:, None] + shift
        cols = torch.arange(ke - ks)[None, :]
        sees = cols <= rows
        if window_size[0] >= 0:
            sees &= cols >= rows - window_size[0]
        qr, kr, vr = (t.transpose(0, 1) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=sees, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1)
    return out


def random_batch(rng: random.Random, num_reqs: int, max_prefix: int, max_extend: int):
    free = list(range(SLOTS))
    rng.shuffle(free)
    ids, prefixes, slots = [], [], []
    for _ in range(num_reqs):
        p, e = rng.randint(0, max_prefix), rng.randint(1, max_extend)
        ids.append([rng.randrange(100) for _ in range(e)])
        prefixes.append(p)
        slots.append([free.pop() for _ in range(p + e)])
    return ForwardBatch.build(ids, prefixes, slots)


def tensors(fb: ForwardBatch, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(fb.num_tokens, HEADS, DIM, generator=gen)
    k_pool = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    v_pool = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen)
    return q, k_pool, v_pool


CASES = [  # (requests, max prefix, max extend, window)
    (1, 0, 40, None),
    (1, 30, 1, None),
    (6, 0, 12, None),
    (8, 30, 12, None),
    (12, 20, 1, None),
    (5, 40, 20, 7),
    (9, 25, 3, 4),
    (3, 0, 30, 64),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_the_backends_match_attention_one_request_at_a_time(case, seed):
    num_reqs, max_prefix, max_extend, window = case
    fb = random_batch(random.Random(seed), num_reqs, max_prefix, max_extend)
    q, k_pool, v_pool = tensors(fb, seed)
    want = reference(q, k_pool, v_pool, fb, window)
    for backend in (TorchNative(), TorchVarlen(kernel=flash_varlen)):
        plan = backend.plan(fb, fb.kv_indices, window)
        got = backend.attend(q, k_pool, v_pool, plan)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


def test_a_sliding_window_reads_no_slot_behind_it():
    """Keys that left the window may have no SWA slot (-1): the plans never read them."""
    fb = random_batch(random.Random(7), 6, 40, 10)
    window = 5
    q, k_pool, v_pool = tensors(fb, 7)
    want = reference(q, k_pool, v_pool, fb, window)
    holed = fb.kv_indices.clone()
    start = 0
    for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu):
        holed[start : start + max(0, p - window + 1)] = -1
        start += p + e
    for backend in (TorchNative(), TorchVarlen(kernel=flash_varlen)):
        got = backend.attend(q, k_pool, v_pool, backend.plan(fb, holed, window))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


def test_alike_requests_share_one_group_and_outliers_get_their_own():
    assert group_requests([16] * 64, [80] * 64) == [list(range(64))]
    extend = [16] * 63 + [4096]
    keys = [80] * 63 + [4096]
    groups = group_requests(extend, keys)
    assert sorted(map(len, groups)) == [1, 63]
    for g in groups:
        exact = sum(extend[r] * keys[r] for r in g)
        assert len(g) * max(extend[r] for r in g) * max(keys[r] for r in g) <= MAX_PADDING * exact


def test_the_default_backend_and_bad_names():
    assert make_backend("auto", "cpu", torch.float32).name == "torch_native"
    with pytest.raises(ValueError, match="needs CUDA"):
        make_backend("torch_varlen", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="attention-backend"):
        make_backend("flashinfer", "cpu", torch.float32)
