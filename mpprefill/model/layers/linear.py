"""Linear layers with tensor parallelism (see `model/parallel.py` for who holds what): the
row-parallel projection, the vocabulary-parallel embedding and head."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mpprefill.model.config import ModelConfig
from mpprefill.model.parallel import TPRank


class RowParallelLinear(nn.Module):
    """y = x_r W_r^T summed over ranks, plus the bias once: the input is this rank's slice
    of the features (its heads, its MLP rows), the output whole."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPRank) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the ids in its vocabulary rows, zeros elsewhere; summed."""

    def __init__(self, config: ModelConfig, tp: TPRank) -> None:
        super().__init__()
        self.tp = tp
        self.rows = tp.vocab(config)
        self.weight = nn.Parameter(torch.empty(tp.vocab_shard(config), config.hidden_size))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x, group=self.tp.group)
        return x


class VocabParallelHead(nn.Module):
    """Each rank's vocabulary rows of the logits, gathered whole on every rank."""

    def __init__(self, config: ModelConfig, tp: TPRank) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = config.vocab_size
        self.weight = nn.Parameter(torch.empty(tp.vocab_shard(config), config.hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local, group=self.tp.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPRank | None) -> nn.Module:
    """A plain Linear at one rank; a row-parallel one (with its all-reduce) at several."""
    if tp is None or tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)
