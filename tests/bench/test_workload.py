from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.bench.workload import (
    WorkloadParams,
    _shared_prefix,
    arrival_times,
    random_prompts,
    simulate_hit_rate,
    solve_for_hit_rate,
)


def trie_hit_rate(prompts, page):
    """Reference: walk a trie of whole pages, match at most (len - 1) rounded down to a page."""
    root, hit, total = {}, 0, 0
    for ids in prompts:
        limit = (len(ids) - 1) // page * page
        node, matched, fresh = root, 0, False
        for start in range(0, len(ids) - page + 1, page):
            key = tuple(ids[start : start + page])
            fresh = fresh or key not in node
            if not fresh and start + page <= limit:
                matched = start + page
            node = node.setdefault(key, {})
        hit, total = hit + matched, total + len(ids)
    return hit / total if total else 0.0


@pytest.mark.parametrize("target", [0.0, 0.5, 0.8])
def test_solver_reaches_target(target):
    work = solve_for_hit_rate(target, num_requests=128, prompt_len=512, page_size=16, seed=3)
    assert abs(work.expected_hit_rate - target) <= 0.05
    assert abs(work.expected_hit_rate - target) <= 0.02  # what the solver promises
    ids = [r.input_ids for r in work.requests]
    assert (
        work.expected_hit_rate
        == simulate_hit_rate(ids, 16)
        == pytest.approx(trie_hit_rate(ids, 16))
    )
    assert len(work) == 128 and all(len(x) == 512 for x in ids)
    assert all(0 < t < 4096 for x in ids for t in x)
    assert work.params.target_hit_rate == target


@pytest.mark.parametrize("target", [0.05, 0.3, 0.9, 0.95])
@pytest.mark.parametrize("page", [1, 16, 64])
def test_solver_other_targets_and_pages(target, page):
    work = solve_for_hit_rate(target, 100, 1024, page, seed=1)
    assert abs(work.expected_hit_rate - target) <= 0.02
    assert work.num_prompt_tokens / 100 == pytest.approx(1024, rel=0.1)


def test_solver_deterministic_under_seed():
    a = solve_for_hit_rate(0.8, 64, 256, seed=11)
    b = solve_for_hit_rate(0.8, 64, 256, seed=11)
    c = solve_for_hit_rate(0.8, 64, 256, seed=12)
    assert a.requests == b.requests and a.expected_hit_rate == b.expected_hit_rate
    assert [r.input_ids for r in a.requests] != [r.input_ids for r in c.requests]
    # the rate changes arrivals only, never the prompts
    d = solve_for_hit_rate(0.8, 64, 256, seed=11, request_rate=5.0)
    assert [r.input_ids for r in d.requests] == [r.input_ids for r in a.requests]
    assert [r.rid for r in a.requests] == [f"r{i}" for i in range(64)]


def test_solver_rejects_unreachable():
    with pytest.raises(ValueError):
        solve_for_hit_rate(0.95, 4, 256)
    with pytest.raises(ValueError):
        solve_for_hit_rate(1.0, 100, 256)


def shared_prefix(groups: int, per_group: int, system_len: int, question_len: int):
    shape = dict(num_groups=groups, prompts_per_group=per_group, question_len=question_len)
    params = WorkloadParams(
        "shared-prefix", groups * per_group, system_prompt_len=system_len, **shape
    )
    return _shared_prefix([per_group] * groups, params)


def test_shared_prefix_closed_form_and_interleaving():
    work = shared_prefix(8, 4, 64, 16)
    assert work.expected_hit_rate == pytest.approx(3 / 4 * 64 / 80)
    assert work.to_dict()["num_groups"] == 8 and work.to_dict()["prompt_tokens"] == 32 * 80
    groups = [tuple(r.input_ids[:64]) for r in work.requests]
    assert len(set(groups)) == 8
    assert groups[:4] != [groups[0]] * 4 and len(set(groups[:8])) > 2  # shuffled
    # unaligned system prompt: only its whole pages are shared
    odd = shared_prefix(4, 4, 40, 8)
    assert odd.expected_hit_rate == pytest.approx(3 / 4 * 32 / 48)


def test_simulate_hand_cases():
    p1 = list(range(1, 9))
    assert simulate_hit_rate([p1, p1], 4) == 4 / 16  # one token must be computed
    assert simulate_hit_rate([p1, p1 + [9]], 4) == 8 / 17
    assert simulate_hit_rate([p1, [1, 2, 3, 4, 5, 6, 0, 0, 0]], 4) == 4 / 17
    assert simulate_hit_rate([p1, [1, 2, 3, 4, 5, 6, 0, 0, 0]], 2) == 6 / 17
    assert simulate_hit_rate([], 4) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=12), min_size=1, max_size=20),
    st.sampled_from([1, 2, 4]),
)
def test_simulate_matches_trie(prompts, page):
    assert simulate_hit_rate(prompts, page) == pytest.approx(trie_hit_rate(prompts, page))


def test_random_prompts_lengths_and_no_sharing():
    work = random_prompts(50, (10, 20), seed=4, vocab_size=1000)
    lens = [len(r.input_ids) for r in work.requests]
    assert min(lens) >= 10 and max(lens) <= 20 and len(set(lens)) > 1
    assert all(0 < t < 1000 for r in work.requests for t in r.input_ids)
    assert work.expected_hit_rate == 0.0 and work.params.kind == "random"
    assert all(r.arrival_s == 0.0 for r in work.requests)


def test_poisson_arrivals_mean_gap():
    times = arrival_times(20_001, request_rate=50.0, seed=5)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std == mean
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(100, 7.0, seed=5) == arrival_times(100, 7.0, seed=5)
    work = random_prompts(10, 8, request_rate=2.0, seed=1)
    assert [r.arrival_s for r in work.requests] == arrival_times(10, 2.0, seed=1)
