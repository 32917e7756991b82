"""One output token's log-probability as replies and the disagg wire carry it (free of
torch, as `params` is)."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """`logprob`: of the sampled token (None where it is not known: a first token whose
    prefill sent none); `top`: [[token_id, logprob], ...] of the request's
    `top_logprobs_num` best tokens, best first ([] when it asked for none)."""

    logprob: float | None
    top: list[list]


UNKNOWN = TokenLogprob(None, [])
