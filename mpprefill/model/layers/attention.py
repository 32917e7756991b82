"""The attention layer: fused q|k|v projection, optional per-head q/k norm, rotary in
place, K and V written to the pool, then one call of the batch's attention backend
(`model/attention.py`) and the output projection. With `attention_sinks` each query head
holds a learned sink logit the backend adds to its softmax denominators (gpt-oss)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model.attention import AttentionBackend
from mpprefill.model.config import ModelConfig
from mpprefill.model.layers.linear import row_linear
from mpprefill.model.layers.norm import QKNorm
from mpprefill.model.layers.rotary import rotate_
from mpprefill.model.parallel import WHOLE, ShardEntry, TPRank, span


class LayerContext(NamedTuple):
    """What every layer of one forward shares."""

    kv: KVCache
    cos: Tensor  # [T, 1, head_dim / 2] in the activations' dtype
    sin: Tensor
    backend: AttentionBackend


class Attention(nn.Module):
    """`config`: this rank's shard (its heads); `qk_norm`: RMS-normalise each head of q and
    k before the rotary (Qwen3)."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp: TPRank | None = None, qk_norm: bool = False
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_head, self.n_kv_head = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_size
        self.qk_size = config.q_size + config.kv_size
        self.wqkv = nn.Linear(
            config.hidden_size, self.qk_size + config.kv_size, bias=config.attention_bias
        )
        self.wo = row_linear(config.q_size, config.hidden_size, config.attention_out_bias, tp)
        self.qk_norm = QKNorm(self.head_dim, self.n_head, config.rms_norm_eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.n_head)) if config.attention_sinks else None

    def forward(self, x: Tensor, ctx: LayerContext, locs: Tensor, plan: Any) -> Tensor:
        n, dim = x.shape[0], self.head_dim
        qkv = self.wqkv(x)
        # q and k side by side: one norm and one in-place rotation for both
        qk = qkv[:, : self.qk_size].view(n, self.n_head + self.n_kv_head, dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        rotate_(qk, ctx.cos, ctx.sin)
        q, k = qk[:, : self.n_head], qk[:, self.n_head :]
        kv = ctx.kv
        kv.write(self.layer_id, locs, k, qkv[:, self.qk_size :].view(n, self.n_kv_head, dim))
        out = ctx.backend.attend(q, kv.k(self.layer_id), kv.v(self.layer_id), plan, self.sinks)
        return self.wo(out.view(n, -1))

    @staticmethod
    def shard_table(
        config: ModelConfig, tp: TPRank, hf: str, ours: str, qk_norm: bool = False
    ) -> dict[str, ShardEntry]:
        """q/k/v/o_proj (and q_norm / k_norm, sinks) under `hf` into wqkv / wo (/ qk_norm,
        sinks) under `ours`, rank `tp.rank`'s heads."""
        dim = config.head_size
        q, kv = span(tp.heads(config), dim), span(tp.kv_heads(config), dim)
        q_len, kv_len = q.stop - q.start, kv.stop - kv.start
        parts = {
            "q_proj": (slice(0, q_len), q),
            "k_proj": (slice(q_len, q_len + kv_len), kv),
            "v_proj": (slice(q_len + kv_len, q_len + 2 * kv_len), kv),
        }
        suffixes = ("weight", "bias") if config.attention_bias else ("weight",)
        table = {
            f"{hf}{proj}.{s}": (f"{ours}wqkv.{s}", dst, rows, WHOLE)
            for proj, (dst, rows) in parts.items()
            for s in suffixes
        }
        table[f"{hf}o_proj.weight"] = (f"{ours}wo.weight", WHOLE, WHOLE, q)
        if config.attention_out_bias:
            table[f"{hf}o_proj.bias"] = (f"{ours}wo.bias", WHOLE, WHOLE, WHOLE)
        if config.attention_sinks:
            table[f"{hf}sinks"] = (f"{ours}sinks", WHOLE, span(tp.heads(config), 1), WHOLE)
        if qk_norm:
            for head in ("q", "k"):
                entry = (f"{ours}qk_norm.{head}_weight", WHOLE, WHOLE, WHOLE)
                table[f"{hf}{head}_norm.weight"] = entry
        return table
