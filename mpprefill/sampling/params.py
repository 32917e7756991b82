"""Per-request sampling parameters, parsed from the request protocol's `sampling_params`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SEED_LIMIT = 2**63
MAX_TOP_LOGPROBS = 20  # top_logprobs_num's limit, as OpenAI's top_logprobs
# NOTE: temperatures below this are treated as greedy: dividing logits by them overflows.
GREEDY_EPS = 1e-6


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{name} must be a number, got {type(value).__name__}")
    try:
        out = float(value)
    except OverflowError as e:
        raise ValueError(f"sampling_params.{name} is out of range: {value!r}") from e
    if not math.isfinite(out):
        raise ValueError(f"sampling_params.{name} must be finite, got {value!r}")
    return out


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name} must be an integer, got {type(value).__name__}")
    return value


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"sampling_params.stop_token_ids must be a list, got {type(value).__name__}"
        )
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"sampling_params.stop_token_ids must hold token ids >= 0, got {t!r}")
    return tuple(value)


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"sampling_params.{name} must be {rule}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its next token. The prefill side samples exactly one.

    Penalties change the logits before temperature, the filters and greedy's argmax:
    `frequency_penalty` and `presence_penalty` (OpenAI's) over the output tokens so far, then
    `repetition_penalty` (transformers') over every token of the prompt or the output so far.
    `return_logprob`: each output token's log-probability under the penalised logits over
    the temperature (1 for greedy rows), and its `top_logprobs_num` best alternatives.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 1
    # Where generation stops (the decode side; the prefill samples one token and ignores them).
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    return_logprob: bool = False
    top_logprobs_num: int = 0  # counts only with return_logprob

    def __post_init__(self) -> None:
        for name in _FLOATS:
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        for name in ("top_k", "max_new_tokens", "top_logprobs_num"):
            _integer(name, getattr(self, name))
        if self.seed is not None:
            _integer("seed", self.seed)
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "return_logprob"):
            if not isinstance(getattr(self, name), bool):
                kind = type(getattr(self, name)).__name__
                raise ValueError(f"sampling_params.{name} must be a boolean, got {kind}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        _require(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _require(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", "-1 or >= 1", self.top_k)
        _require(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        seed_ok = self.seed is None or 0 <= self.seed < SEED_LIMIT
        _require(seed_ok, "seed", "null or an integer in [0, 2**63)", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        rep = self.repetition_penalty
        _require(0.0 < rep <= 2.0, "repetition_penalty", "in (0, 2]", rep)
        top = self.top_logprobs_num
        limit = MAX_TOP_LOGPROBS
        _require(0 <= top <= limit, "top_logprobs_num", f"in [0, {limit}]", top)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Any penalty changes the logits (on the prefill only the repetition penalty can:
        its first token has no output before it)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives each output token reports: top_logprobs_num with return_logprob."""
        return self.top_logprobs_num if self.return_logprob else 0

    @classmethod
    def from_dict(cls, d: Any) -> SamplingParams:
        """Parse a JSON `sampling_params` object; every problem is a ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"sampling_params has unknown field(s): {', '.join(unknown)}")
        return cls(**d)
