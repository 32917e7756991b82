"""Multi-head latent attention (DeepSeek): each token keeps one latent row per layer in the
KV pool, and every head's K and V are decompressed from the rows of the keys it attends.

    x --w_a--> | q part | latent c [kv_lora_rank] | k_pe [qk_rope_head_dim] |
    q part --(q_norm, wq_b: with q_lora_rank)--> q [H, nope | rope]
    pool row = | rms_norm(c) | rotated k_pe |      (written at the token's slot)
    row of every key --wkv_b--> [H, k_nope | v];  k = | k_nope | k_pe | (k_pe every head's)

The q projection (or q's low-rank down projection) and the latent's are one matmul
(`w_a`). The rope turns only the last `qk_rope_head_dim` dims of q and k; the checkpoint
lays its pairs out adjacent (`rope_interleave`), which `rotate_interleaved_` turns into
the halves layout for q and k alike, so the pool keeps k_pe rotated, halves layout.

Prefill decompresses the keys, not the queries: the rows of every key of the batch (its
prefix read back from the pool, its new tokens just written) go through `wkv_b` once per
layer, and the backend attends over the per-head K [N, H, nope + rope] and V [N, H, v] as
over any pool, by a plan whose key slots are rows of those tensors (`LatentPlan`). The
absorbed form (wkv_b's K half folded into q, its V half into the output, attention over
the latent rows directly) reads fewer bytes per key and is what a decode step wants; in
prefill the queries outnumber the new keys, so absorbing costs a rank-sized head
(kv_lora_rank + rope, 576 against 192) in every q.k product of every query, while
decompressing costs one matmul per key. The softmax scale is qk_head_dim^-0.5, times
yarn's mscale(f, mscale_all_dim)^2 where the rope names it (folded into q).

At several tensor-parallel ranks each rank computes its heads, as SGLang does without
DP attention: its rows of q's projection (`q_proj`, or `q_b_proj` after the whole low-rank
`q_a_proj`), of `kv_b_proj` and its columns of `o_proj` (row-parallel, all-reduced). The
latent's projection and norm are whole on every rank, so every rank writes the same rows
to its own latent pool (replicated, not split) and one rank's pool is shipped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from mpprefill.model.attention import AttentionBackend
from mpprefill.model.config import ModelConfig
from mpprefill.model.forward_batch import ForwardBatch
from mpprefill.model.layers.attention import LayerContext
from mpprefill.model.layers.linear import row_linear
from mpprefill.model.layers.norm import RMSNorm
from mpprefill.model.layers.rotary import rotate_, rotate_interleaved_, softmax_factor
from mpprefill.model.parallel import WHOLE, ShardEntry, TPRank, span


class LatentPlan(NamedTuple):
    """A forward's plan for its latent-attention layers."""

    key_slots: Tensor  # [sum(p_r + e_r)] pool slots of every request's keys (kv_indices)
    attention: Any  # the backend's plan over the keys as gathered: key i at row i

    @classmethod
    def of(cls, backend: AttentionBackend, fb: ForwardBatch) -> LatentPlan:
        keys = fb.kv_indices
        rows = torch.arange(keys.shape[0], device=keys.device)
        return cls(keys, backend.plan(fb, rows, None))


class LatentAttention(nn.Module):
    """`config`: a latent-attention model's (`ModelConfig.kv_lora_rank`), this rank's shard
    (its heads)."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TPRank | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_head = config.num_attention_heads
        self.kv_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        self.qk_dim = config.qk_head_dim
        self.interleaved = config.rope_interleave
        self.scale = softmax_factor(config.rope_scaling)
        hidden, q_size = config.hidden_size, self.n_head * self.qk_dim
        q_rank = config.q_lora_rank
        self.q_a_size = q_rank or q_size
        self.w_a = nn.Linear(hidden, self.q_a_size + config.kv_latent_dim, bias=False)
        self.q_norm = RMSNorm(q_rank, config.rms_norm_eps) if q_rank else None
        self.wq_b = nn.Linear(q_rank, q_size, bias=False) if q_rank else None
        self.kv_norm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, self.n_head * (self.nope_dim + self.v_dim), bias=False)
        self.wo = row_linear(self.n_head * self.v_dim, hidden, False, tp)

    def forward(self, x: Tensor, ctx: LayerContext, locs: Tensor, plan: LatentPlan) -> Tensor:
        n = x.shape[0]
        a = self.w_a(x)
        q = a[:, : self.q_a_size]
        if self.wq_b is not None:
            q = self.wq_b(self.q_norm(q))
        q = q.view(n, self.n_head, self.qk_dim)
        latent, k_pe = a[:, self.q_a_size :].split([self.kv_rank, self.rope_dim], dim=-1)
        rows = torch.cat((self.kv_norm(latent), k_pe), dim=-1)
        rotate = rotate_interleaved_ if self.interleaved else rotate_
        rotate(q[..., self.nope_dim :], ctx.cos, ctx.sin)
        rotate(rows[:, None, self.kv_rank :], ctx.cos, ctx.sin)
        ctx.kv.write_latent(self.layer_id, locs, rows)
        keys = ctx.kv.latent_rows(self.layer_id).index_select(0, plan.key_slots)
        k, v = self._decompress(keys.to(x.dtype))
        if self.scale != 1.0:
            q = q * self.scale
        out = ctx.backend.attend(q, k, v, plan.attention)
        return self.wo(out.reshape(n, self.n_head * self.v_dim))

    def _decompress(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Every head's K [N, H, nope + rope] and V [N, H, v] of latent rows [N, rank + rope]."""
        n = rows.shape[0]
        latent, k_pe = rows.split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(latent).view(n, self.n_head, self.nope_dim + self.v_dim)
        k_pe = k_pe[:, None].expand(n, self.n_head, self.rope_dim)
        k = torch.cat((kv[..., : self.nope_dim], k_pe), dim=-1)
        return k, kv[..., self.nope_dim :]

    @staticmethod
    def shard_table(config: ModelConfig, tp: TPRank, hf: str, ours: str) -> dict[str, ShardEntry]:
        """q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm,
        kv_b_proj and o_proj under `hf` into w_a (q rows, then the latent's), q_norm, wq_b,
        kv_norm, wkv_b and wo under `ours`: rank `tp.rank`'s heads of the per-head ones."""
        q_rank = config.q_lora_rank
        heads = tp.heads(config)
        q_heads = span(heads, config.qk_head_dim)  # rows of q_proj / q_b_proj
        q_rows = q_rank or q_heads.stop - q_heads.start  # rows of w_a before the latent's
        whole = lambda name: (f"{ours}{name}", WHOLE, WHOLE, WHOLE)  # noqa: E731
        table = {
            f"{hf}kv_a_proj_with_mqa.weight": (
                f"{ours}w_a.weight",
                slice(q_rows, q_rows + config.kv_latent_dim),
                WHOLE,
                WHOLE,
            ),
            f"{hf}kv_a_layernorm.weight": whole("kv_norm.weight"),
            f"{hf}kv_b_proj.weight": (
                f"{ours}wkv_b.weight",
                WHOLE,
                span(heads, config.qk_nope_head_dim + config.v_head_dim),
                WHOLE,
            ),
            f"{hf}o_proj.weight": (
                f"{ours}wo.weight",
                WHOLE,
                WHOLE,
                span(heads, config.v_head_dim),
            ),
        }
        if q_rank:
            table[f"{hf}q_a_proj.weight"] = (f"{ours}w_a.weight", slice(0, q_rank), WHOLE, WHOLE)
            table[f"{hf}q_a_layernorm.weight"] = whole("q_norm.weight")
            table[f"{hf}q_b_proj.weight"] = (f"{ours}wq_b.weight", WHOLE, q_heads, WHOLE)
        else:
            table[f"{hf}q_proj.weight"] = (f"{ours}w_a.weight", slice(0, q_rows), q_heads, WHOLE)
        return table
