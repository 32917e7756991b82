"""The gated MLP (SwiGLU): gate and up fused in one projection, down row-parallel."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from mpprefill.model.config import ModelConfig
from mpprefill.model.layers.linear import row_linear
from mpprefill.model.parallel import WHOLE, ShardEntry, TPRank, span


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPRank | None = None) -> None:
        super().__init__()
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = row_linear(config.intermediate_size, config.hidden_size, False, tp)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate, inplace=True).mul_(up))

    @staticmethod
    def shard_table(config: ModelConfig, tp: TPRank, hf: str, ours: str) -> dict[str, ShardEntry]:
        """gate_proj / up_proj / down_proj under `hf` into w13 / w2 under `ours`."""
        rows = span(tp.intermediate(config), 1)
        n = rows.stop - rows.start
        return {
            f"{hf}gate_proj.weight": (f"{ours}w13.weight", slice(0, n), rows, WHOLE),
            f"{hf}up_proj.weight": (f"{ours}w13.weight", slice(n, 2 * n), rows, WHOLE),
            f"{hf}down_proj.weight": (f"{ours}w2.weight", WHOLE, WHOLE, rows),
        }
