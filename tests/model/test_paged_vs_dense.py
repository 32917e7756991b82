"""Chunked, paged, ragged prefill against a dense full-sequence reference written here."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM, ModelConfig

PROMPT_LENS = (37, 16, 1, 50, 23)
ATOL = 1e-4


def small_config(**overrides) -> ModelConfig:
    dims = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=50000.0,
        max_position_embeddings=512,
        attention_bias=True,
    )
    return ModelConfig(**{**dims, **overrides})


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(small_config())
    m.init_random_weights(seed=3, std=0.1)
    return m


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(n)] for n in PROMPT_LENS]


# ---- dense reference: whole sequence, no cache, rotary via complex numbers -----------------


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, D]: pair element i with i + D/2 and turn it by pos * theta^(-2i/D)."""
    t, _, d = x.shape
    angles = torch.arange(t, dtype=torch.float64)[:, None] * theta ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * turn
    return torch.cat((z.real, z.imag), dim=-1).float()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def dense_attention(q, k, v, cfg: ModelConfig) -> torch.Tensor:
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_size)
    t = q.shape[0]
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)


def dense_forward(model: LlamaForCausalLM, ids: list[int]):
    """Logits at every position [T, vocab] and per-layer post-rotary (K, V) [T, H_kv, D]."""
    cfg, p = model.config, model.state_dict()
    x = p["tok_embeddings.weight"][torch.tensor(ids)]
    kvs = []
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        h = rms(x, p[pre + "attention_norm.weight"], cfg.rms_norm_eps)
        qkv = h @ p[pre + "attention.wqkv.weight"].T + p.get(pre + "attention.wqkv.bias", 0.0)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = rotate(q.reshape(len(ids), -1, cfg.head_size), cfg.rope_theta)
        k = rotate(k.reshape(len(ids), -1, cfg.head_size), cfg.rope_theta)
        v = v.reshape(len(ids), -1, cfg.head_size)
        kvs.append((k, v))
        x = x + dense_attention(q, k, v, cfg) @ p[pre + "attention.wo.weight"].T
        h = rms(x, p[pre + "ffn_norm.weight"], cfg.rms_norm_eps)
        gate, up = (h @ p[pre + "feed_forward.w13.weight"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ p[pre + "feed_forward.w2.weight"].T
    logits = rms(x, p["norm.weight"], cfg.rms_norm_eps) @ p["output.weight"].T
    return logits, kvs


# ---- paged, chunked prefill -----------------------------------------------------------------


def page_slots(lens: list[int], page_size: int, seed: int) -> list[list[int]]:
    """Whole-sequence slots per request from shuffled pages (a non-full tail is a page)."""
    pages_needed = [-(-n // page_size) for n in lens]
    pages = list(range(1, sum(pages_needed) + 8))
    random.Random(seed).shuffle(pages)
    slots, it = [], iter(pages)
    for n, count in zip(lens, pages_needed, strict=True):
        own = [next(it) for _ in range(count)]
        slots.append([own[j // page_size] * page_size + j % page_size for j in range(n)])
    return slots


def chunked_prefill(model, kv, ids, slots, budget: int) -> dict[tuple[int, int], torch.Tensor]:
    """Run every prompt in token-budgeted ragged batches; logits keyed by (request, last pos)."""
    done, out = [0] * len(ids), {}
    while any(d < len(r) for d, r in zip(done, ids, strict=True)):
        left, reqs, takes = budget, [], []
        for r, prompt in enumerate(ids):
            take = min(len(prompt) - done[r], left)
            if take > 0:
                reqs.append(r)
                takes.append(take)
                left -= take
        fb = ForwardBatch.build(
            [ids[r][done[r] : done[r] + n] for r, n in zip(reqs, takes, strict=True)],
            [done[r] for r in reqs],
            [slots[r][: done[r] + n] for r, n in zip(reqs, takes, strict=True)],
        )
        logits = model(fb, kv)
        for row, (r, n) in enumerate(zip(reqs, takes, strict=True)):
            done[r] += n
            out[(r, done[r] - 1)] = logits[row]
    return out


def num_slots(slots: list[list[int]]) -> int:
    return max(max(s) for s in slots) + 1


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("budget", [7, 13, 200])
def test_paged_chunked_prefill_equals_dense(model, page_size, budget):
    ids = prompts()
    slots = page_slots([len(p) for p in ids], page_size, seed=budget)
    kv = KVCache.for_model(model.config, num_slots(slots) + page_size)
    got = chunked_prefill(model, kv, ids, slots, budget)
    for r, prompt in enumerate(ids):
        dense_logits, dense_kv = dense_forward(model, prompt)
        chunk_ends = [pos for (req, pos) in got if req == r]
        for pos in chunk_ends:
            torch.testing.assert_close(got[(r, pos)], dense_logits[pos], atol=ATOL, rtol=0)
        cached = kv.gather(torch.tensor(slots[r]))
        for layer, (k, v) in enumerate(dense_kv):
            torch.testing.assert_close(cached[0, layer], k, atol=ATOL, rtol=0)
            torch.testing.assert_close(cached[1, layer], v, atol=ATOL, rtol=0)


def test_tied_model_without_bias_matches_dense():
    m = LlamaForCausalLM(small_config(tie_word_embeddings=True, attention_bias=False))
    m.init_random_weights(seed=5, std=0.1)
    assert m.output.weight is m.tok_embeddings.weight
    ids = prompts(seed=1)[:2]
    slots = page_slots([len(p) for p in ids], 4, seed=0)
    kv = KVCache.for_model(m.config, num_slots(slots))
    got = chunked_prefill(m, kv, ids, slots, budget=10)
    for r, prompt in enumerate(ids):
        dense_logits, _ = dense_forward(m, prompt)
        torch.testing.assert_close(got[(r, len(prompt) - 1)], dense_logits[-1], atol=ATOL, rtol=0)


def test_prefix_reuse_gives_same_logits(model):
    ids = prompts(seed=2)
    first = page_slots([len(p) for p in ids], 16, seed=7)
    kv = KVCache.for_model(model.config, 4096)
    chunked_prefill(model, kv, ids, first, budget=64)
    # Second round: each request reuses a prefix of its first-round KV; fresh slots for the rest.
    prefix_lens = [32, 15, 0, 49, 9]
    fresh = iter(range(2048, 4096))
    slots = [s[:p] + [next(fresh) for _ in s[p:]] for s, p in zip(first, prefix_lens, strict=True)]
    fb = ForwardBatch.build(
        [p[n:] for p, n in zip(ids, prefix_lens, strict=True)], prefix_lens, slots
    )
    reused = model(fb, kv)
    full = model(ForwardBatch.build(ids, [0] * len(ids), slots), kv)
    torch.testing.assert_close(reused, full, atol=ATOL, rtol=0)
    for r, prompt in enumerate(ids):
        dense_logits, _ = dense_forward(model, prompt)
        torch.testing.assert_close(reused[r], dense_logits[-1], atol=ATOL, rtol=0)
