"""Llama / Qwen2 decoder over a paged KV cache, prefill only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model.attention import AttentionBackend, make_backend
from mpprefill.model.config import ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.parallel import (
    TPRank,
    VocabParallelEmbedding,
    VocabParallelHead,
    row_linear,
    shard_config,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPRank | None = None) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = row_linear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate, inplace=True).mul_(up))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_head, self.n_kv_head = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_size
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.wqkv = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)
        self.wo = row_linear(config.q_size, config.hidden_size, config.attention_out_bias, tp)

    def forward(self, x: Tensor, ctx: LayerContext, locs: Tensor, plan: Any) -> Tensor:
        n, dim = x.shape[0], self.head_dim
        qkv = self.wqkv(x)
        # q and k side by side: one in-place rotation for both
        qk = qkv[:, : self.sizes[0] + self.sizes[1]].view(n, self.n_head + self.n_kv_head, dim)
        rotate_(qk, ctx.cos, ctx.sin)
        q, k, v = qkv.split(self.sizes, dim=-1)
        kv = ctx.kv
        kv.write(self.layer_id, locs, k.view(n, self.n_kv_head, dim), v.view(n, -1, dim))
        q = q.view(n, self.n_head, dim)
        out = ctx.backend.attend(q, kv.k(self.layer_id), kv.v(self.layer_id), plan)
        return self.wo(out.view(n, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.attention = Attention(config, layer_id, tp)
        self.feed_forward = FeedForward(config, tp)
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: LayerContext, locs: Tensor, plan: Any) -> Tensor:
        h = x + self.attention(self.attention_norm(x), ctx, locs, plan)
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
        self.rotary = Rotary(
            config.head_size, config.rope_theta, config.max_position_embeddings, device
        )
        self.set_attention_backend("auto")

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

    def set_attention_backend(self, name: str) -> None:
        """`--attention-backend`: see `attention.make_backend`."""
        self.attention_backend = make_backend(name, self.device, self.config.torch_dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, kv: KVCache, on_layer: Callable[[int], None] | None = None
    ) -> Tensor:
        """Float32 logits [B, vocab] at each request's last new token. `on_layer(i)` runs
        once layer i's work is issued (an emulated device charges its time there).

        The host reads only the batch's host lengths (see `ForwardBatch`)."""
        x = self.tok_embeddings(fb.input_ids)
        cos, sin = self.rotary.at(fb.positions, fb.max_seq_len, x.dtype)
        ctx = LayerContext(kv, cos, sin, self.attention_backend)
        backend = self.attention_backend
        full = (fb.out_cache_loc, backend.plan(fb, fb.kv_indices, None))
        sliding = full
        if self.config.has_sliding_layers:
            swa_locs, swa_indices = fb.swa_slots()
            sliding = (swa_locs, backend.plan(fb, swa_indices, self.config.sliding_window))
        for i, layer in enumerate(self.layers):
            locs, plan = sliding if self.config.is_sliding(i) else full
            x = layer(x, ctx, locs, plan)
            if on_layer is not None:
                on_layer(i)
        x = x.index_select(0, fb.last_token_indices)
        return self.output(self.norm(x)).float()


class LayerContext(NamedTuple):
    """What every layer of one forward shares."""

    kv: KVCache
    cos: Tensor  # [T, 1, head_dim / 2] in the activations' dtype
    sin: Tensor
    backend: AttentionBackend


class Rotary:
    """cos and sin of the rotary angles of positions 0 .. n - 1, float32, on the model's
    device; grown (doubled) when a batch reaches past them. A head's two halves rotate as
    pairs (the rotate_half convention of Llama and Qwen checkpoints)."""

    def __init__(self, head_dim: int, theta: float, positions: int, device) -> None:
        exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        self._fill(positions)

    def _fill(self, n: int) -> None:
        angles = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        self.cos, self.sin = angles.cos(), angles.sin()

    def reserve(self, n: int) -> None:
        """Hold positions 0 .. n - 1 at least (`n`: a host value)."""
        if n > self.cos.shape[0]:
            self._fill(max(n, 2 * self.cos.shape[0]))

    def at(self, positions: Tensor, max_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim / 2] of `positions` (all < max_len, a host value)."""
        self.reserve(max_len)
        cos = self.cos.index_select(0, positions).to(dtype)
        sin = self.sin.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] in place by its token's angles (cos, sin [T, 1, d/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).add_(x1_sin)
    return x
