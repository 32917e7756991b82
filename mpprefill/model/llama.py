"""Llama / Qwen2 decoder over a paged KV cache, prefill only."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model.config import ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.parallel import (
    TPRank,
    VocabParallelEmbedding,
    VocabParallelHead,
    row_linear,
    shard_config,
)


class Span(NamedTuple):
    """One request of a ragged batch: its rows of the new tokens and its whole-sequence slots."""

    rows: slice
    kv_slots: Tensor
    mask: Tensor | None
    causal: bool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPRank | None = None) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = row_linear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_head, self.n_kv_head = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_size
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.wqkv = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)
        self.wo = row_linear(config.q_size, config.hidden_size, config.attention_out_bias, tp)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        kv: KVCache,
        locs: Tensor,
        spans: list[Span],
    ) -> Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        q = apply_rope(q.view(n, self.n_head, self.head_dim), *rope)
        k = apply_rope(k.view(n, self.n_kv_head, self.head_dim), *rope)
        kv.write(self.layer_id, locs, k, v.view(n, self.n_kv_head, self.head_dim))
        out = torch.empty_like(q)
        k_pool, v_pool = kv.k(self.layer_id), kv.v(self.layer_id)
        for s in spans:
            k_seq, v_seq = k_pool[s.kv_slots], v_pool[s.kv_slots]
            out[s.rows] = attend(q[s.rows], k_seq.to(q.dtype), v_seq.to(q.dtype), s)
        return self.wo(out.view(n, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.attention = Attention(config, layer_id, tp)
        self.feed_forward = FeedForward(config, tp)
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], kv: KVCache, locs: Tensor, spans: list[Span]
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, kv, locs, spans)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaForCausalLM(nn.Module):
    """Weights start uninitialised: call init_random_weights() or load a state dict.

    With `tp` of several ranks the model holds one rank's shard (see `parallel.py`): its
    heads and MLP rows (`kv_config`, the shape its KV pool takes) and its vocabulary rows;
    `config` stays the whole model's."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", tp: TPRank | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.kv_config = config if self.tp is None else shard_config(config, self.tp)
        with torch.device("meta"):
            self._build(config)
        self.to(config.torch_dtype).to_empty(device=device)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.requires_grad_(False).eval()

    def _build(self, config: ModelConfig) -> None:
        tp, local = self.tp, self.kv_config
        if tp is None:
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.tok_embeddings = VocabParallelEmbedding(config, tp)
        blocks = (TransformerBlock(local, i, tp) for i in range(config.num_hidden_layers))
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if tp is None:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.output = VocabParallelHead(config, tp)

    @torch.inference_mode()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Seeded normal(0, std) weights and unit norms; same seed, same bits, any process."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if isinstance(self.get_submodule(name.rpartition(".")[0]), RMSNorm):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, kv: KVCache, on_layer: Callable[[int], None] | None = None
    ) -> Tensor:
        """Float32 logits [B, vocab] at each request's last new token. `on_layer(i)` runs
        once layer i's work is issued (an emulated device charges its time there)."""
        x = self.tok_embeddings(fb.input_ids)
        rope = rope_cos_sin(fb.positions, self.config.head_size, self.config.rope_theta)
        spans = ragged_spans(fb, fb.kv_indices)
        swa_locs, swa_spans = fb.out_cache_loc, spans
        if self.config.has_sliding_layers:
            swa_locs, swa_indices = fb.swa_slots()
            swa_spans = ragged_spans(fb, swa_indices, self.config.sliding_window)
        for i, layer in enumerate(self.layers):
            sliding = self.config.is_sliding(i)
            locs, layer_spans = (swa_locs, swa_spans) if sliding else (fb.out_cache_loc, spans)
            x = layer(x, rope, kv, locs, layer_spans)
            if on_layer is not None:
                on_layer(i)
        x = x[fb.last_token_indices]
        return self.output(self.norm(x)).float()


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, head_dim] in float32, halves repeated (the HF rotate_half convention)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by its token's angles."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def attend(q: Tensor, k: Tensor, v: Tensor, span: Span) -> Tensor:
    """q [e, H, D] over k, v [prefix + e, H_kv, D]; returns [e, H, D]."""
    # NOTE: 4-D [1, heads, len, dim] inputs; 3-D ones take the slow math kernel on the CPU.
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=span.mask, is_causal=span.causal, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def ragged_spans(fb: ForwardBatch, kv_indices: Tensor, window: int | None = None) -> list[Span]:
    """Per-request row ranges, KV slots and masks, computed once per forward for all layers
    (once more for sliding-window layers, with `window` and their own pool's slots).

    A sliding-window span starts at the first key its first query sees, max(0, p - W + 1):
    keys before it may already be gone from the SWA pool.
    """
    spans, row, kv_start = [], 0, 0
    for prefix, extend in zip(fb.prefix_lens.tolist(), fb.extend_lens.tolist(), strict=True):
        kv_end = kv_start + prefix + extend
        first_key = 0 if window is None else max(0, prefix - window + 1)
        if window is not None and prefix + extend > window:
            mask = sliding_window_mask(prefix, extend, window, fb.input_ids.device, first_key)
            causal = False
        else:
            mask = prefix_causal_mask(prefix, extend, fb.input_ids.device)
            causal = prefix == 0 and extend > 1
        slots = kv_indices[kv_start + first_key : kv_end]
        if window is not None and bool((slots < 0).any()):
            raise RuntimeError("a key inside the sliding window has no SWA slot")
        spans.append(Span(slice(row, row + extend), slots, mask, causal))
        row, kv_start = row + extend, kv_end
    return spans


def sliding_window_mask(
    prefix: int, extend: int, window: int, device: torch.device, first_key: int = 0
) -> Tensor:
    """Boolean [extend, prefix + extend - first_key]: the new token at position p sees keys
    p - window < j <= p, of keys first_key, first_key + 1, ..., prefix + extend - 1."""
    keys = torch.arange(first_key, prefix + extend, device=device)
    queries = torch.arange(prefix, prefix + extend, device=device)[:, None]
    return (keys[None, :] <= queries) & (keys[None, :] > queries - window)


def prefix_causal_mask(prefix: int, extend: int, device: torch.device) -> Tensor | None:
    """Boolean [extend, prefix + extend]: new token i sees keys j <= prefix + i.

    None when no mask is needed (no prefix: plain causal; one new token: sees everything).
    """
    if prefix == 0 or extend == 1:
        return None
    keys = torch.arange(prefix + extend, device=device)
    queries = torch.arange(prefix, prefix + extend, device=device)
    return keys[None, :] <= queries[:, None]
