"""The mixture-of-experts MLP: a router picks each token's top-k experts, the routed rows
are sorted by expert and every expert's rows go through its gated MLP in one grouped
matmul, then each row, scaled by its routing weight, is added back to its token.

Every expert's weights are stacked (gate|up fused [E, 2I, H], down [E, H, I]), so one call
covers all experts. The shapes are host-known: T tokens make T * k routed rows whatever the
routing, and the experts' boundaries in them stay on the device as the grouped matmul's
offsets, never read by the host.

    routed row j = (token j // k, its (j % k)-th expert)
    sorted by expert:  | expert 0's rows | expert 1's rows | ... |  ends = offsets[e]

gpt-oss's experts (`stacked`) keep the layout its checkpoint stacks them in: gate|up
[E, H, 2I] with gate and up interleaved column by column (gate at even columns, up at odd
ones), down [E, I, H], with biases on both and on the router, and its clamped SwiGLU
(`ModelConfig.swiglu_limit`). Interleaved, a TP rank's rows of I are one run of columns.

DeepSeek's routing (`ModelConfig.moe_scoring` "sigmoid") scores each expert by a sigmoid
of its float32 logit; a learned per-expert bias (`score_bias`, float32 like the router's
weight) shifts the scores for the choice only: among the `topk_group` groups whose two best
biased scores sum highest (of `n_group` groups), a token takes its top-k experts, weighted
by their unbiased scores (renormalised with `norm_topk_prob`) times
`routed_scaling_factor`. Shared experts (`shared_expert_intermediate_size`) are one dense
gated MLP every token runs, added to the routed sum.

Where the grouped matmul does not take the device and dtype (CUDA in other than bfloat16),
every expert runs over every token and the routing weights, zero for the experts a token
did not pick, sum them: E / k times the work, the same host-known shapes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mpprefill.model.config import ModelConfig
from mpprefill.model.layers.mlp import GatedMLP
from mpprefill.model.parallel import WHOLE, ShardEntry, TPRank, span


class ExpertNames(NamedTuple):
    """A family's checkpoint names of a sparse MLP under its layer's prefix; expert e's
    projections are `{block}experts.{e}.{gate|up|down}.weight`, or, `stacked`, every
    expert's in `{block}experts.{gate}` (gate and up together) and `{block}experts.{down}`,
    their biases beside them with `_bias`."""

    block: str = "mlp."
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    stacked: bool = False


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` takes these operands: any dtype on the CPU, bfloat16 on CUDA."""
    return device.type == "cpu" or dtype == torch.bfloat16


class SparseMoE(nn.Module):
    """`config`: this rank's shard (its `moe_intermediate_size` rows of every expert); at
    several ranks the output is all-reduced. `grouped`: the grouped matmul (True) or every
    expert over every token (False); None: the grouped matmul where it runs. `stacked`:
    gpt-oss's layout of the experts (see the module doc)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TPRank | None = None,
        grouped: bool | None = None,
        stacked: bool = False,
    ) -> None:
        super().__init__()
        self.grouped = grouped
        self.stacked = stacked
        experts, hidden = config.num_experts, config.hidden_size
        inter = config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.router = nn.Linear(hidden, experts, bias=config.expert_bias)
        w13 = (experts, hidden, 2 * inter) if stacked else (experts, 2 * inter, hidden)
        w2 = (experts, inter, hidden) if stacked else (experts, hidden, inter)
        self.w13 = nn.Parameter(torch.empty(w13))
        self.w2 = nn.Parameter(torch.empty(w2))
        self.b13 = self.b2 = None
        if config.expert_bias:
            self.b13 = nn.Parameter(torch.empty(experts, 2 * inter))
            self.b2 = nn.Parameter(torch.empty(experts, hidden))
        # NOTE: the down bias is added once, by rank 0, before the all-reduce.
        self.down_bias = self.b2 is not None and (self.tp is None or self.tp.rank == 0)
        self.grouped_routing = config.moe_scoring == "sigmoid"
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling = config.routed_scaling_factor
        self.score_bias = nn.Parameter(torch.empty(experts)) if self.grouped_routing else None
        # parameters the model keeps in float32 whatever its dtype (see CausalLM)
        self.float32_params = ("router.weight", "score_bias") if self.grouped_routing else ()
        self.shared = None
        if config.shared_expert_intermediate_size:
            self.shared = GatedMLP(_shared_config(config), tp)

    def _gate_up(self) -> Tensor:
        """Every expert's gate|up weights as the right operand of x @ W: [E, H, 2I]."""
        return self.w13 if self.stacked else self.w13.transpose(1, 2)

    def _down(self) -> Tensor:
        """[E, I, H]."""
        return self.w2 if self.stacked else self.w2.transpose(1, 2)

    def _activate(self, gate_up: Tensor) -> Tensor:
        """SiLU(gate) * up, or gpt-oss's clamped form (see ModelConfig.swiglu_limit)."""
        if self.stacked:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is None:
            return F.silu(gate).mul_(up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit).add_(1)
        return gate.mul_(torch.sigmoid(gate * self.alpha)).mul_(up)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(x)
        grouped = self.grouped
        if grouped is None:
            grouped = grouped_mm_runs(x.device, x.dtype)
        experts_of = self._grouped if grouped else self._dense
        out = experts_of(x, weights, experts)
        if self.tp is not None:
            dist.all_reduce(out, group=self.tp.group)
        if self.shared is not None:
            out += self.shared(x)
        return out

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top-k routing weights (in x's dtype) and experts, [T, k] each."""
        if self.grouped_routing:
            return self._route_by_groups(x)
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _route_by_groups(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """DeepSeek's routing (see the module doc)."""
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight))
        choice = scores + self.score_bias
        if self.topk_group < self.n_group:
            choice = self._in_best_groups(choice)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return (weights * self.routed_scaling).to(x.dtype), experts

    def _in_best_groups(self, choice: Tensor) -> Tensor:
        """`choice` [T, E] at -inf outside each token's `topk_group` best groups, a group
        worth the sum of its two best scores."""
        t, e = choice.shape
        groups = choice.view(t, self.n_group, e // self.n_group)
        worth = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = worth.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)

    def _grouped(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        sorted_experts, order = torch.sort(experts.view(-1), stable=True)
        ids = torch.arange(self.w13.shape[0], device=x.device)
        offsets = torch.searchsorted(sorted_experts, ids, right=True, out_int32=True)
        tokens = order.div(self.top_k, rounding_mode="floor")
        rows = x.index_select(0, tokens)
        gate_up = F.grouped_mm(rows, self._gate_up(), offs=offsets)
        if self.b13 is not None:
            gate_up += self.b13.index_select(0, sorted_experts)
        y = F.grouped_mm(self._activate(gate_up), self._down(), offs=offsets)
        if self.down_bias:
            y += self.b2.index_select(0, sorted_experts)
        y.mul_(weights.view(-1).index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, y)

    def _dense(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        gate_up = torch.matmul(x, self._gate_up())  # [E, T, 2I]
        if self.b13 is not None:
            gate_up += self.b13.unsqueeze(1)
        y = torch.matmul(self._activate(gate_up), self._down())  # [E, T, H]
        if self.down_bias:
            y += self.b2.unsqueeze(1)
        dense = torch.zeros(x.shape[0], self.w13.shape[0], dtype=x.dtype, device=x.device)
        dense.scatter_(1, experts, weights)  # [T, E]: zero where a token did not route
        return torch.einsum("te,eth->th", dense, y)

    @staticmethod
    def shard_table(
        config: ModelConfig, tp: TPRank, hf: str, ours: str, names: ExpertNames
    ) -> dict[str, ShardEntry]:
        """The router and every expert's projections under `hf` + `names.block` into router /
        w13 / w2 under `ours`: rank `tp.rank`'s rows of each expert."""
        rows = span(tp.moe_intermediate(config), 1)
        n = rows.stop - rows.start
        block = f"{hf}{names.block}"
        table = {f"{block}{names.router}.weight": (f"{ours}router.weight", WHOLE, WHOLE, WHOLE)}
        if config.expert_bias:
            table[f"{block}{names.router}.bias"] = (f"{ours}router.bias", WHOLE, WHOLE, WHOLE)
        if config.moe_scoring == "sigmoid":
            bias = f"{block}{names.router}.e_score_correction_bias"
            table[bias] = (f"{ours}score_bias", WHOLE, WHOLE, WHOLE)
        if config.shared_expert_intermediate_size:
            shared = _shared_config(config)
            table |= GatedMLP.shard_table(shared, tp, f"{block}shared_experts.", f"{ours}shared.")
        if names.stacked:
            return table | _stacked_table(config, tp, f"{block}experts.", ours, names)
        for e in range(config.num_experts):
            expert = f"{block}experts.{e}."
            table[f"{expert}{names.gate}.weight"] = (f"{ours}w13", (e, slice(0, n)), rows, WHOLE)
            table[f"{expert}{names.up}.weight"] = (f"{ours}w13", (e, slice(n, 2 * n)), rows, WHOLE)
            table[f"{expert}{names.down}.weight"] = (f"{ours}w2", (e, WHOLE), WHOLE, rows)
        return table


def _shared_config(config: ModelConfig) -> ModelConfig:
    """The shape of the shared experts' MLP."""
    return dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)


def _stacked_table(
    config: ModelConfig, tp: TPRank, hf: str, ours: str, names: ExpertNames
) -> dict[str, ShardEntry]:
    """gpt-oss's stacked experts: rows and columns index each expert's matrix (the loader
    reads a 3-D tensor as [:, rows, cols]); gate and up interleaved, so rank r's rows of I
    are the columns [2 r I / N, 2 (r + 1) I / N)."""
    rows = span(tp.moe_intermediate(config), 1)
    cols = span(tp.moe_intermediate(config), 2)
    gate_up, down = f"{hf}{names.gate}", f"{hf}{names.down}"
    table = {
        gate_up: (f"{ours}w13", WHOLE, WHOLE, cols),
        down: (f"{ours}w2", WHOLE, rows, WHOLE),
    }
    if config.expert_bias:
        table[f"{gate_up}_bias"] = (f"{ours}b13", WHOLE, WHOLE, cols)
        table[f"{down}_bias"] = (f"{ours}b2", WHOLE, WHOLE, WHOLE)
    return table
