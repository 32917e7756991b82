"""RMS norms: over the hidden state, and over each head of q and k (Qwen3's q/k norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class QKNorm(nn.Module):
    """RMS norm of every head of q and of k, q's heads by one weight and k's by another:
    normalised in one call over q and k side by side [T, H + H_kv, D], then scaled."""

    def __init__(self, head_dim: int, n_head: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.n_head = n_head
        self.q_weight = nn.Parameter(torch.empty(head_dim))
        self.k_weight = nn.Parameter(torch.empty(head_dim))

    def forward(self, qk: Tensor) -> Tensor:
        """A new [T, H + H_kv, D] tensor: q's heads then k's, each normalised."""
        out = F.rms_norm(qk, self.q_weight.shape, None, self.eps)
        out[:, : self.n_head].mul_(self.q_weight)
        out[:, self.n_head :].mul_(self.k_weight)
        return out
