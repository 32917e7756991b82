from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.sampler import sample

LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -6.0]


def _sample(logits: list[list[float]], params: list[SamplingParams], step: int = 0) -> list[int]:
    info = SamplingBatchInfo.from_params(params, len(logits[0]))
    return sample(torch.tensor(logits, dtype=torch.float32), info, step).tolist()


def _seeded(n: int, **kw: float) -> list[SamplingParams]:
    return [SamplingParams(seed=s, **kw) for s in range(n)]


def reference(logits: list[float], p: SamplingParams, slack: float = 0.0) -> dict[int, float]:
    """Filtered, renormalised distribution; `slack` widens it for boundary rounding."""
    m = max(logits)
    weights = [math.exp((x - m) / p.temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: (-weights[i], i))
    if p.top_k != -1:
        order = order[: p.top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += weights[i] / total
        if mass >= p.top_p + slack:
            break
    top = weights[kept[0]]
    kept = [i for i in kept if weights[i] >= (p.min_p - slack) * top]
    total = sum(weights[i] for i in kept)
    return {i: weights[i] / total for i in kept}


def _chi_square(tokens: list[int], probs: dict[int, float]) -> float:
    assert set(tokens) <= set(probs)
    n = len(tokens)
    return sum((tokens.count(i) - n * q) ** 2 / (n * q) for i, q in probs.items())


def test_greedy_is_argmax_lowest_index_on_ties() -> None:
    logits = [[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -0.5]]
    assert _sample(logits, [SamplingParams()] * 3) == [1, 0, 2]


def test_greedy_rows_in_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50).tolist()
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 3
    out = _sample(logits, params)
    argmax = torch.tensor(logits).argmax(-1).tolist()
    assert [out[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 30).tolist()
    params = [SamplingParams(temperature=temperature, top_k=1, seed=s) for s in range(64)]
    params[0] = SamplingParams(temperature=1.0)  # keeps the batch off the all-greedy path
    out = _sample(logits, params)
    assert out[1:] == torch.tensor(logits).argmax(-1).tolist()[1:]


def test_tiny_top_p_keeps_only_top_token() -> None:
    out = _sample([LOGITS] * 500, _seeded(500, temperature=5.0, top_p=1e-6))
    assert set(out) == {0}


def test_min_p_never_draws_filtered_tokens() -> None:
    p = SamplingParams(temperature=1.0, min_p=0.3)
    allowed = set(reference(LOGITS, p))
    assert allowed == {0, 1, 2}
    out = _sample([LOGITS] * 3000, _seeded(3000, temperature=1.0, min_p=0.3))
    assert set(out) == allowed


def test_top_k_never_draws_past_k() -> None:
    out = _sample([LOGITS] * 2000, _seeded(2000, temperature=10.0, top_k=3))
    assert set(out) == {0, 1, 2}


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
    ],
)
def test_seeded_draws_match_filtered_softmax(kw: dict) -> None:
    n = 4000
    expected = reference(LOGITS, SamplingParams(**kw))
    tokens = _sample([LOGITS] * n, _seeded(n, **kw), step=3)
    # df <= 7; 30 is far in the tail (p < 1e-4), and the seeds are fixed.
    assert _chi_square(tokens, expected) < 30.0


def test_seed_independent_of_batch_and_position() -> None:
    torch.manual_seed(2)
    rows = torch.randn(12, 100).tolist()
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=1000 + i) for i in range(12)]
    alone = [_sample([rows[i]], [params[i]])[0] for i in range(12)]
    assert _sample(rows, params) == alone
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3)).tolist()
    shuffled = _sample([rows[i] for i in perm], [params[i] for i in perm])
    assert shuffled == [alone[i] for i in perm]
    padded = _sample(
        rows[:5] + [rows[7]] * 9, [SamplingParams(temperature=2.0)] * 5 + [params[7]] * 9
    )
    assert padded[5:] == [alone[7]] * 9


def test_step_changes_the_draw() -> None:
    params = _seeded(200, temperature=1.0)
    a = _sample([LOGITS] * 200, params, step=0)
    b = _sample([LOGITS] * 200, params, step=1)
    assert a == _sample([LOGITS] * 200, params, step=0)
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 50


def test_unseeded_rows_follow_generator() -> None:
    params = [SamplingParams(temperature=1.0)] * 100 + [SamplingParams(temperature=1.0, seed=5)]
    info = SamplingBatchInfo.from_params(params, len(LOGITS))
    logits = torch.tensor([LOGITS] * 101)
    a = sample(logits, info, generator=torch.Generator().manual_seed(9))
    b = sample(logits, info, generator=torch.Generator().manual_seed(9))
    c = sample(logits, info, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a, b) and not torch.equal(a[:100], c[:100])
    assert a[100] == c[100]


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.integers(-8, 8).map(lambda x: x / 2), min_size=2, max_size=12),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.integers(-1, 12).filter(lambda k: k != 0),
    top_p=st.sampled_from([0.05, 0.5, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**63 - 1),
)
def test_draw_is_always_allowed(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float, seed: int
) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    allowed = reference(logits, p, slack=1e-4)
    out = _sample([logits] * 4, [p] * 4, step=seed % 7)
    assert out[0] in allowed and len(set(out)) == 1


def test_per_row_steps_equal_one_step_per_row() -> None:
    """A [B] step tensor draws each row as a batch run at that row's step alone would."""
    params = _seeded(30, temperature=1.0) + [SamplingParams(seed=2**63 - 1, temperature=1.0)]
    steps = [(i * 7 + 1) * 3**i % 2**45 for i in range(len(params))]
    info = SamplingBatchInfo.from_params(params, len(LOGITS))
    logits = torch.tensor([LOGITS] * len(params), dtype=torch.float32)
    got = sample(logits, info, torch.tensor(steps)).tolist()
    one_by_one = [_sample([LOGITS], [p], step=s)[0] for p, s in zip(params, steps, strict=True)]
    assert got == one_by_one
    assert got != sample(logits, info, 0).tolist()  # the steps matter
