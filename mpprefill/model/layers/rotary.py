"""Rotary position embeddings: the inverse frequencies of each scaling type, a cached
cos/sin table, and the in-place rotation of q and k.

| type    | inverse frequency of pair i (d = head_dim, b = theta, f = factor)         | cos/sin x |
|---------|---------------------------------------------------------------------------|-----------|
| default | b^(-2i/d)                                                                 | 1         |
| linear  | b^(-2i/d) / f                                                             | 1         |
| dynamic | default with b' = b (f L / M - (f - 1))^(d / (d - 2)), L = max(len, M)     | 1         |
| llama3  | long wavelengths / f, short ones kept, a smooth ramp between              | 1         |
| yarn    | a ramp from b^(-2i/d) (fast pairs) to b^(-2i/d) / f (slow pairs)           | mscale    |

(M: max_position_embeddings; len: the longest sequence of the batch, a host value.) The
formulas follow transformers' `modeling_rope_utils.py`, the oracle of `tests/model`.

Latent attention (DeepSeek) rotates only the `qk_rope_head_dim` part of each head (the
config's head_dim is that part), its pairs adjacent in the checkpoint's layout
(`rotate_interleaved_`), and under yarn with `mscale_all_dim` also scales its softmax by
mscale(f, mscale_all_dim)^2 (`softmax_factor`), the unrotated dims included.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mpprefill.model.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig, seq_len: int | None = None) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32 on the host, cos/sin factor) of the
    config's rotary. `seq_len` matters to `dynamic` only."""
    dim, theta, scaling = config.head_size, config.rope_theta, config.rope_scaling
    if scaling is None:
        return _default(theta, dim), 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return _default(theta, dim) / scaling.factor, 1.0
    if kind == "dynamic":
        return _dynamic(config, scaling, dim, seq_len), 1.0
    if kind == "llama3":
        return _llama3(scaling, _default(theta, dim)), 1.0
    return _yarn(config, scaling, dim), _yarn_attention_factor(scaling)


def _default(theta: float, dim: int) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _dynamic(config: ModelConfig, scaling: RopeScaling, dim: int, seq_len: int | None) -> Tensor:
    limit = config.max_position_embeddings
    length = max(seq_len or limit, limit)
    f = scaling.factor
    theta = config.rope_theta * ((f * length / limit) - (f - 1)) ** (dim / (dim - 2))
    return _default(theta, dim)


def _llama3(scaling: RopeScaling, inv_freq: Tensor) -> Tensor:
    f, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = context / low, context / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / f, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / f + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: ModelConfig, scaling: RopeScaling, dim: int) -> Tensor:
    theta, f = config.rope_theta, scaling.factor
    context = scaling.original_max_position_embeddings
    fast = scaling.beta_fast or 32
    slow = scaling.beta_slow or 1

    def pair_of(rotations: float) -> float:
        """The (fractional) pair index that turns `rotations` times over the context."""
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(fast), pair_of(slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolates); 0: divided by f
    powers = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (f * powers)) * (1 - keep) + (1.0 / powers) * keep


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_factor(scaling: RopeScaling | None) -> float:
    """What latent attention multiplies its softmax scale (head_dim^-0.5) by: yarn's
    mscale(f, mscale_all_dim) squared where the scaling names mscale_all_dim, else 1."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return _mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _mscale(scaling.factor, scaling.mscale) / _mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _mscale(scaling.factor)


class Rotary:
    """cos and sin (times the scaling's factor) of the rotary angles of positions
    0 .. n - 1, float32, on the model's device; grown (doubled) when a batch reaches past
    them. A head's two halves rotate as pairs (the rotate_half convention of these
    checkpoints).

    NOTE: `dynamic` scaling changes the frequencies with the sequence length. A batch whose
    longest sequence (a host value) exceeds max_position_embeddings gets a table of its
    own, kept until a batch of another length needs another; keys already in the pool keep
    the angles they were written with, as in transformers' own cache."""

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        self.config = config
        self.device = torch.device(device)
        scaling = config.rope_scaling
        self.dynamic = scaling is not None and scaling.rope_type == "dynamic"
        self.cos, self.sin = self._table(config.max_position_embeddings, None)
        self._long: tuple[int, Tensor, Tensor] | None = None  # dynamic: (length, cos, sin)

    def _table(self, n: int, seq_len: int | None) -> tuple[Tensor, Tensor]:
        inv_freq, factor = inverse_frequencies(self.config, seq_len)
        inv_freq = inv_freq.to(self.device)
        angles = torch.arange(n, device=self.device).float()[:, None] * inv_freq
        if factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * factor, angles.sin() * factor

    def reserve(self, n: int) -> None:
        """Hold positions 0 .. n - 1 at least (`n`: a host value)."""
        if n > self.cos.shape[0]:
            self.cos, self.sin = self._table(max(n, 2 * self.cos.shape[0]), None)

    def tables(self, max_len: int) -> tuple[Tensor, Tensor]:
        """The float32 cos and sin tables for a batch whose longest sequence is `max_len`."""
        if not (self.dynamic and max_len > self.config.max_position_embeddings):
            self.reserve(max_len)
            return self.cos, self.sin
        if self._long is None or self._long[0] != max_len:
            self._long = (max_len, *self._table(max_len, max_len))
        return self._long[1], self._long[2]

    def at(self, positions: Tensor, max_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim / 2] of `positions` (all < max_len, a host value)."""
        cos_table, sin_table = self.tables(max_len)
        cos = cos_table.index_select(0, positions).to(dtype)
        sin = sin_table.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def rotate_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] in place by its token's angles (cos, sin [T, 1, d/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).add_(x1_sin)
    return x


def rotate_interleaved_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, d] whose pairs are adjacent, (x0, x1), (x2, x3), .., and leave
    it in the halves layout: pair i at i and i + d / 2. q and k both leave so, which keeps
    every q.k product, and keys enter the pool so."""
    pairs = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # a copy, halves layout
    x.copy_(rotate_(pairs, cos, sin))
    return x
