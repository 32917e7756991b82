"""Penalties on the logits, before temperature, the filters and greedy's argmax.

    frequency, presence (OpenAI's; the output so far):
        logit[t] -= frequency_penalty * count_out(t) + presence_penalty * (count_out(t) > 0)
    repetition (transformers'; every token of the prompt or the output so far):
        logit[t] = logit[t] / p  if logit[t] > 0  else  logit[t] * p

Rows without a penalty have the neutral values (0, 0, 1), which leave their logits exactly
as they were, so a batch is penalised as a whole.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpprefill.sampling.info import ROW_SHIFT, SamplingBatchInfo

_ID_MASK = (1 << ROW_SHIFT) - 1


class TokenHistory(NamedTuple):
    """What the penalties read, per row; None where no row has any."""

    output_counts: torch.Tensor | None  # [B, V] int: each token's count in the output so far
    prompt_mask: torch.Tensor | None  # [B, V] bool: the token occurs in the prompt


def prompt_mask(info: SamplingBatchInfo, vocab_size: int) -> torch.Tensor | None:
    """[B, V] bool from `info.penalty_ids` (the prefill's prompts); None when it has none."""
    ids = info.penalty_ids
    if ids.numel() == 0:
        return None
    mask = torch.zeros(info.batch_size, vocab_size, dtype=torch.bool, device=ids.device)
    mask[ids >> ROW_SHIFT, ids & _ID_MASK] = True
    return mask


def apply_penalties(
    logits: torch.Tensor, info: SamplingBatchInfo, history: TokenHistory
) -> torch.Tensor:
    """[B, V] float32 penalised logits (a new tensor; `logits` is left as it was)."""
    out = logits.float()
    counts = history.output_counts
    seen = history.prompt_mask
    if counts is not None:
        used = counts > 0
        out = out - info.frequency_penalties[:, None] * counts.float()
        out = out - info.presence_penalties[:, None] * used.float()
        seen = used if seen is None else seen | used
    if seen is not None:
        rep = info.repetition_penalties[:, None]
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    return out
