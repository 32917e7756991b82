"""The batched attention backends against attention computed one request at a time, with
and without attention sinks."""

from __future__ import annotations

import random

import pytest
import torch

from mpprefill.model import ForwardBatch
from mpprefill.model.attention import (
    MAX_PADDING,
    TorchNative,
    TorchVarlen,
    _math_with_lse,
    attention_with_lse,
    group_requests,
    make_backend,
)

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 512


def attention(q, k, v, sees, sinks=None):
    """q [E, H, D] over k, v [K, H_kv, D] where `sees` [E, K], written out: the scores, a
    sink logit per head as one more column of each softmax (no value), then the weighted
    values. Returns the output [E, H, D] and the log-sum-exp [H, E] without the sink."""
    rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh, vh = (t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
    scores = (qh @ kh.transpose(1, 2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~sees, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        column = sinks[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : kh.shape[1]]
    return (probs @ vh).transpose(0, 1), lse


def reference(q, k_pool, v_pool, fb: ForwardBatch, window: int | None, sinks=None):
    """Request by request: its queries over its keys, masked as the module doc says."""
    out = q.new_empty(*q.shape[:2], v_pool.shape[-1])
    row = key = 0
    for p, e in zip(fb.prefix_lens.tolist(), fb.extend_lens.tolist()):
        slots = fb.kv_indices[key : key + p + e]
        keys = torch.arange(p + e)
        queries = torch.arange(p, p + e)[:, None]
        sees = keys[None, :] <= queries
        if window is not None:
            sees &= keys[None, :] > queries - window
        kv = (k_pool[slots], v_pool[slots])
        out[row : row + e] = attention(q[row : row + e], *kv, sees, sinks)[0]
        row, key = row + e, key + p + e
    return out


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, window_size, enable_gqa):
    """What torch's flash varlen kernel computes, one sequence at a time: the causal
    diagonal aligned to the end of each sequence's keys, `window_size[0]` keys to the left;
    with `return_aux.lse`, also the log-sum-exp [H, T] (the kernel's layout)."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and enable_gqa
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0])
    for i in range(len(cu_q) - 1):
        (qs, qe), (ks, ke) = cu_q[i : i + 2].tolist(), cu_k[i : i + 2].tolist()
        shift = (ke - ks) - (qe - qs)
        rows = torch.arange(qe - qs)[:, None] + shift
        cols = torch.arange(ke - ks)[None, :]
        sees = cols <= rows
        if window_size[0] >= 0:
            sees &= cols >= rows - window_size[0]
        out[qs:qe], lse[:, qs:qe] = attention(q[qs:qe], k[ks:ke], v[ks:ke], sees)
    if return_aux is not None and return_aux.lse:
        return out, lse
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


def random_sinks(seed: int):
    return 2.0 * torch.randn(HEADS, generator=torch.Generator().manual_seed(seed + 100))


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_the_backends_match_attention_one_request_at_a_time(case, seed, sinks):
    num_reqs, max_prefix, max_extend, window = case
    fb = random_batch(random.Random(seed), num_reqs, max_prefix, max_extend)
    q, k_pool, v_pool = tensors(fb, seed)
    s = random_sinks(seed) if sinks else None
    want = reference(q, k_pool, v_pool, fb, window, s)
    for backend in (TorchNative(), TorchVarlen(kernel=flash_varlen)):
        plan = backend.plan(fb, fb.kv_indices, window)
        got = backend.attend(q, k_pool, v_pool, plan, s)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


@pytest.mark.parametrize("case", CASES[2:6])
def test_values_narrower_than_the_queries(case):
    """Latent attention's V (v_head_dim) is narrower than its q and k: both backends give
    [T, H, D_v] (torch_varlen pads V to the kernel's one head dim and cuts the output)."""
    num_reqs, max_prefix, max_extend, window = case
    fb = random_batch(random.Random(0), num_reqs, max_prefix, max_extend)
    q, k_pool, v_pool = tensors(fb, 0)
    v_pool = v_pool[..., :5].contiguous()
    want = reference(q, k_pool, v_pool, fb, window)
    for backend in (TorchNative(), TorchVarlen(kernel=flash_varlen)):
        got = backend.attend(q, k_pool, v_pool, backend.plan(fb, fb.kv_indices, window))
        assert got.shape == (fb.num_tokens, HEADS, 5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


@pytest.mark.parametrize("causal", [False, True])
def test_the_log_sum_exp_written_out_matches_the_cpu_kernels(causal):
    """The form other devices than the CPU take (the scores written out) against the CPU's
    flash kernel, with a mask and without."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, HEADS, 10, DIM, generator=gen)
    k, v = (torch.randn(3, KV_HEADS, 10, DIM, generator=gen) for _ in range(2))
    masks = [None] if causal else [None, torch.rand(3, 1, 10, 10, generator=gen) > 0.3]
    for mask in masks:
        if mask is not None:
            mask[..., 0] = True  # every query sees a key
        want_out, want_lse = attention_with_lse(q, k, v, mask, causal)
        rep = HEADS // KV_HEADS
        k2, v2 = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out, lse = _math_with_lse(q, k2, v2, mask, causal)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_a_sliding_window_reads_no_slot_behind_it(sinks):
    """Keys that left the window may have no SWA slot (-1): the plans never read them."""
    fb = random_batch(random.Random(7), 6, 40, 10)
    window = 5
    q, k_pool, v_pool = tensors(fb, 7)
    s = random_sinks(7) if sinks else None
    want = reference(q, k_pool, v_pool, fb, window, s)
    holed = fb.kv_indices.clone()
    start = 0
    for p, e in zip(fb.prefix_lens_cpu, fb.extend_lens_cpu):
        holed[start : start + max(0, p - window + 1)] = -1
        start += p + e
    for backend in (TorchNative(), TorchVarlen(kernel=flash_varlen)):
        got = backend.attend(q, k_pool, v_pool, backend.plan(fb, holed, window), s)
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
