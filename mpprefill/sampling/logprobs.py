"""Log-probabilities of sampled tokens: log_softmax(penalised logits / T)[token], T the
row's temperature (1 for a greedy row), and the row's best alternatives under the same
distribution. Only the rows that ask are computed; a batch where none asks costs nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mpprefill.sampling.info import SamplingBatchInfo, greedy_rows
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.token_logprob import TokenLogprob


class Logprobs(NamedTuple):
    """One row per request of the batch; a row that did not ask holds NaN and id -1.
    K is the batch's `max_top_logprobs`: a row reads its own first top_logprobs_num."""

    token: torch.Tensor  # [B] float32, of the sampled token
    top_ids: torch.Tensor  # [B, K] int64, best first
    top: torch.Tensor  # [B, K] float32


def compute_logprobs(
    logits: torch.Tensor, info: SamplingBatchInfo, tokens: torch.Tensor
) -> Logprobs | None:
    """`logits`: [B, V] penalised; `tokens`: [B] sampled. None when no row asks."""
    if not info.logprob_rows:
        return None
    device = logits.device
    rows = torch.tensor(info.logprob_rows, dtype=torch.int64, device=device)
    greedy = greedy_rows(info.temperatures, info.top_ks)[rows]
    temperatures = torch.where(greedy[:, None], 1.0, info.temperatures[rows])
    logp = torch.log_softmax(logits[rows].float() / temperatures, dim=-1)
    picked = logp.gather(1, tokens[rows][:, None]).squeeze(1)
    top, top_ids = torch.topk(logp, info.max_top_logprobs, dim=-1)
    b = info.batch_size
    out = Logprobs(
        torch.full((b,), float("nan"), device=device),
        torch.full((b, top.shape[1]), -1, dtype=torch.int64, device=device),
        torch.full((b, top.shape[1]), float("nan"), device=device),
    )
    out.token[rows] = picked
    out.top_ids[rows] = top_ids
    out.top[rows] = top
    return out


def to_host(lp: Logprobs | None, params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """Each row's TokenLogprob (None for a row that did not ask), from one read of `lp`."""
    if lp is None:
        return [None] * len(params)
    token = lp.token.tolist()
    ids = lp.top_ids.tolist()
    top = lp.top.tolist()
    out: list[TokenLogprob | None] = []
    for i, p in enumerate(params):
        k = p.num_top_logprobs
        pairs = [[t, v] for t, v in zip(ids[i][:k], top[i][:k], strict=True)]
        out.append(TokenLogprob(token[i], pairs) if p.return_logprob else None)
    return out
