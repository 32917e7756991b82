"""Token sampling: penalties, then greedy, temperature, top-k, top-p, min-p, with
per-request seeds; the sampled tokens' logprobs for the rows that ask.

A seeded row draws its uniform from a counter-based hash of (seed, step), then inverts the
CDF of its filtered distribution, so its token depends only on its own logits, seed and
step, never on the rest of the batch. `step` is one int for the whole batch, or one per row
(a decode batch mixes requests at different completion tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpprefill.sampling.info import SamplingBatchInfo, greedy_rows
from mpprefill.sampling.logprobs import Logprobs, compute_logprobs
from mpprefill.sampling.penalty import TokenHistory, apply_penalties, prompt_mask

_MASK32 = 0xFFFFFFFF
_STEP_KEY = 0x9E3779B9


class Sampled(NamedTuple):
    tokens: torch.Tensor  # [B] int64
    logprobs: Logprobs | None  # None when no row asks


def sample(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    step: int | torch.Tensor = 0,
    generator: torch.Generator | None = None,
    history: TokenHistory | None = None,
) -> torch.Tensor:
    """[B, V] float32 logits -> [B] int64 token ids (`sample_with_logprobs`' tokens)."""
    return sample_with_logprobs(logits, info, step, generator, history).tokens


def sample_with_logprobs(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    step: int | torch.Tensor = 0,
    generator: torch.Generator | None = None,
    history: TokenHistory | None = None,
) -> Sampled:
    """Penalise, draw, and the logprobs of the rows that ask. Unseeded rows draw from
    `generator`; `step`: an int, or [B] int64 (each row's own step). `history`: the
    output's token counts and the prompts' tokens (the decode side's); None: the prompts
    in `info.penalty_ids` (the prefill's, whose output is empty)."""
    if info.has_penalties:
        if history is None:
            history = TokenHistory(None, prompt_mask(info, logits.shape[-1]))
        logits = apply_penalties(logits, info, history)
    tokens = _draw(logits, info, step, generator)
    return Sampled(tokens, compute_logprobs(logits, info, tokens))


def _draw(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    step: int | torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    greedy_ids = torch.argmax(logits, dim=-1)
    if info.all_greedy:
        return greedy_ids
    greedy = greedy_rows(info.temperatures, info.top_ks)
    temperatures = torch.where(greedy[:, None], 1.0, info.temperatures)
    probs = torch.softmax(logits.float() / temperatures, dim=-1)
    sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    kept = filter_sorted(sorted_probs, info.top_ks, info.top_ps, info.min_ps)
    uniform = _uniforms(info, step, generator)
    drawn = sorted_ids.gather(1, _invert_cdf(kept, uniform)[:, None]).squeeze(1)
    return torch.where(greedy, greedy_ids, drawn)


def filter_sorted(
    sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Zero the tokens that top-k, then top-p, then min-p drop; the top token always stays.

    Input and output are unnormalised [B, V] probabilities sorted descending.
    """
    ranks = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)
    probs = sorted_probs.masked_fill(ranks[None, :] >= top_ks[:, None], 0.0)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    limit = top_ps[:, None] * probs.sum(dim=-1, keepdim=True)
    # NOTE: top_p == 1 skips the test: cumsum rounding would otherwise drop a tiny tail.
    drop_p = (mass_before >= limit) & (top_ps[:, None] < 1.0)
    probs = probs.masked_fill(drop_p, 0.0)
    return probs.masked_fill(probs < min_ps[:, None] * probs[:, :1], 0.0)


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] sorted positions: the first whose cumulative mass exceeds uniform * total."""
    cdf = torch.cumsum(probs, dim=-1)
    threshold = (uniform * cdf[:, -1])[:, None].contiguous()
    pos = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    # NOTE: kept tokens form a prefix; rounding can push the threshold past the last one.
    last_kept = (probs > 0).sum(dim=-1) - 1
    return torch.minimum(pos, last_kept)


def _uniforms(
    info: SamplingBatchInfo, step: int | torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    device = info.seeds.device
    free = torch.rand(info.batch_size, generator=generator, device=device)
    return torch.where(info.has_seed, seeded_uniforms(info.seeds, step), free)


def seeded_uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """[B] float32 in [0, 1), a pure function of each (seed, step); `step` an int or [B]."""
    steps = torch.as_tensor(step, dtype=torch.int64, device=seeds.device).expand_as(seeds)
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    h = _mix32(((steps & _MASK32) ^ _STEP_KEY) & _MASK32)
    h = _mix32(h ^ lo)
    h = _mix32(h ^ hi)
    h = _mix32(h ^ ((steps >> 32) & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (xorshift-multiply), on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 without overflowing int64: c is split into 16-bit halves."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32
