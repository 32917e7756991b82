"""Deterministic bench workloads: shared-prefix groups or random prompts, with arrival times.

Shared-prefix groups follow SGLang's generated-shared-prefix set: each group has its own random
system prompt; each prompt is that system prompt plus a random question. Tokens are drawn
uniformly from [1, vocab_size). Prompts, order and arrivals use separate seeded streams, so
changing the request rate does not change the prompts.

The expected hit rate is not the closed formula but a simulation over the generated prompts in
their shuffled order: an unbounded page-aligned prefix cache, no concurrency, each prompt
matching whole cached pages but leaving at least one token to compute (as admission does).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

INF = math.inf
DEFAULT_VOCAB = 4096  # the built-in model's


@dataclass(frozen=True, slots=True)
class RequestSpec:
    rid: str
    input_ids: list[int]
    arrival_s: float


@dataclass(frozen=True)
class WorkloadParams:
    kind: str  # "shared-prefix" | "random"
    num_requests: int
    num_groups: int = 0
    prompts_per_group: int = 0  # the largest group's size when groups differ by one
    system_prompt_len: int = 0
    question_len: int = 0
    len_range: tuple[int, int] | None = None
    vocab_size: int = DEFAULT_VOCAB
    page_size: int = 16
    request_rate: float = INF
    seed: int = 0
    target_hit_rate: float | None = None

    def __post_init__(self):
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2 (token 0 is never drawn)")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")


@dataclass
class Workload:
    requests: list[RequestSpec]
    params: WorkloadParams
    expected_hit_rate: float  # achieved, simulated over `requests`

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.requests)

    def to_dict(self) -> dict:
        """Parameters and achieved figures (not the prompts), for bench JSON."""
        out = asdict(self.params)
        out.update(expected_hit_rate=self.expected_hit_rate, prompt_tokens=self.num_prompt_tokens)
        return out


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """First request at 0; then exponential gaps of mean 1/rate (Poisson); inf: all at 0."""
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = _rng(seed, 2).exponential(1.0 / request_rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def simulate_hit_rate(prompts: Iterable[Sequence[int]], page_size: int) -> float:
    """Fraction of prompt tokens a page-aligned, unbounded prefix cache serves, in order.

    A prompt matches the whole pages it shares with any earlier prompt (its longest common
    prefix with the set, found at its neighbours in sorted order), at most (len - 1) rounded
    down to a page, so one token is always computed.
    """
    keys: list[tuple[int, ...]] = []
    arrays: list[np.ndarray] = []
    hit = total = 0
    for ids in prompts:
        key, arr = tuple(ids), np.asarray(ids, dtype=np.int64)
        i = bisect.bisect_left(keys, key)
        near = [arrays[j] for j in (i - 1, i) if 0 <= j < len(keys)]
        common = max((_common_prefix(arr, other) for other in near), default=0)
        limit = (len(key) - 1) // page_size * page_size
        hit += min(common // page_size * page_size, limit)
        total += len(key)
        keys.insert(i, key)
        arrays.insert(i, arr)
    return hit / total if total else 0.0


def _finish(prompts: list[list[int]], params: WorkloadParams) -> Workload:
    order = _rng(params.seed, 1).permutation(len(prompts))
    times = arrival_times(len(prompts), params.request_rate, params.seed)
    reqs = [RequestSpec(f"r{i}", prompts[j], t) for i, (j, t) in enumerate(zip(order, times))]
    hit = simulate_hit_rate((r.input_ids for r in reqs), params.page_size)
    return Workload(reqs, params, hit)


def _group_sizes(n: int, groups: int) -> list[int]:
    return [n // groups + (1 if g < n % groups else 0) for g in range(groups)]


def _shared_prefix(sizes: list[int], params: WorkloadParams) -> Workload:
    rng, vocab = _rng(params.seed, 0), params.vocab_size
    systems = rng.integers(1, vocab, size=(len(sizes), params.system_prompt_len))
    questions = rng.integers(1, vocab, size=(sum(sizes), params.question_len))
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    prompts = [
        np.concatenate([systems[g], q]).tolist() for g, q in zip(group_of.tolist(), questions)
    ]
    return _finish(prompts, params)


def random_prompts(
    n: int,
    len_range: tuple[int, int] | int,
    *,
    vocab_size: int = DEFAULT_VOCAB,
    page_size: int = 16,
    request_rate: float = INF,
    seed: int = 0,
) -> Workload:
    """n prompts of independent random tokens, lengths uniform in len_range (inclusive)."""
    lo, hi = (len_range, len_range) if isinstance(len_range, int) else len_range
    if not 1 <= lo <= hi:
        raise ValueError(f"len_range must satisfy 1 <= lo <= hi, got {len_range}")
    kw = dict(vocab_size=vocab_size, page_size=page_size, request_rate=request_rate, seed=seed)
    params = WorkloadParams("random", n, len_range=(lo, hi), **kw)
    rng = _rng(seed, 0)
    lens = rng.integers(lo, hi + 1, size=n)
    prompts = [rng.integers(1, vocab_size, size=int(k)).tolist() for k in lens]
    return _finish(prompts, params)


PER_GROUP = 16  # SGLang's default prompts per group; the solver stays near it when it can
Plan = tuple[int, int, int]  # (groups, system_len, question_len)


def _plan_rate(plan: Plan, n: int) -> float:
    g, s, q = plan
    return (n - g) / n * s / (s + q)


def _group_counts(n: int) -> Iterable[int]:
    if n <= 4096:
        return range(1, n)
    return np.unique(np.linspace(1, n - 1, 4096).round().astype(int)).tolist()


def _exact_length_plans(t: float, n: int, length: int, page: int) -> Iterable[Plan]:
    """For each page-aligned system length, the group counts closest to the target."""
    for s in range(page, length, page):
        f = t * length / s  # (n - groups) / n needed
        if f <= 1:
            for g in {math.floor(n * (1 - f)), math.ceil(n * (1 - f))}:
                yield min(max(g, 1), n), s, length - s


def _free_length_plans(t: float, n: int, length: int, page: int) -> Iterable[Plan]:
    """For each group count, system length near r * length and the question that fits r."""
    for g in _group_counts(n):
        r = t * n / (n - g)
        if r >= 1:
            continue
        base = round(r * length / page)
        shortest = math.ceil(r / (1 - r) / page)  # question of one token
        for s in {max(page, (k + d) * page) for k in (base, shortest) for d in (-1, 0, 1)}:
            q = s * (1 - r) / r
            for qi in {max(1, math.floor(q)), max(1, math.ceil(q))}:
                yield g, s, qi


def _plan(t: float, n: int, length: int, page: int, tol: float) -> Plan:
    def cost(plan: Plan) -> tuple:
        g, s, q = plan
        err = abs(_plan_rate(plan, n) - t)
        return (err if err > tol else 0.0, abs(s + q - length), abs(n / g - PER_GROUP), -s)

    plans = [*_exact_length_plans(t, n, length, page), *_free_length_plans(t, n, length, page)]
    if not plans:
        raise ValueError(f"hit rate {t} cannot be reached with {n} request(s)")
    return min(plans, key=cost)


def solve_for_hit_rate(
    target: float,
    num_requests: int,
    prompt_len: int,
    page_size: int = 16,
    *,
    vocab_size: int = DEFAULT_VOCAB,
    request_rate: float = INF,
    seed: int = 0,
    tolerance: float = 0.02,
) -> Workload:
    """A shared-prefix workload whose simulated hit rate is within `tolerance` of `target`.

    With G groups over n requests (group sizes differ by at most one), a page-aligned system
    prompt of s tokens and a question of q, each group's first prompt misses, so
    hit = (n - G)/n * s/(s + q). Among (G, s, q) candidates (s + q = prompt_len for every
    page-aligned s; and, per G, s near the needed ratio with q fitted to it) the solver takes:
      1. a closed-form rate within tolerance/2 of the target (else the closest one),
      2. then the total length s + q closest to prompt_len (page rounding moves it only when
         no split of prompt_len is on target: very high targets, prompts of a few pages),
      3. then groups of about SGLang's 16 prompts.
    It then generates the prompts, simulates, and raises ValueError if the simulated rate is
    off by more than `tolerance`. Target 0 gives plain random prompts of prompt_len.
    """
    if not 0 <= target < 1:
        raise ValueError(f"target hit rate must be in [0, 1), got {target}")
    if num_requests < 1 or prompt_len < 2:
        raise ValueError("need num_requests >= 1 and prompt_len >= 2")
    kw = dict(vocab_size=vocab_size, page_size=page_size, request_rate=request_rate, seed=seed)
    if target == 0:
        work = random_prompts(num_requests, prompt_len, **kw)
        work.params = dataclasses.replace(work.params, target_hit_rate=0.0)
        return work
    g, s, q = _plan(target, num_requests, prompt_len, page_size, tolerance / 2)
    sizes = _group_sizes(num_requests, g)
    shape = dict(num_groups=g, prompts_per_group=max(sizes), system_prompt_len=s, question_len=q)
    params = WorkloadParams("shared-prefix", num_requests, **shape, target_hit_rate=target, **kw)
    work = _shared_prefix(sizes, params)
    if abs(work.expected_hit_rate - target) > tolerance:
        raise ValueError(f"hit rate {work.expected_hit_rate:.3f} is off target {target}: {params}")
    return work
