"""Offline API through the in-process modes: results, chunk accounting, bad input."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model

LOCAL_MODES = ["normal", "overlap", "thread", "thread-ahead"]
# NOTE: one torch thread (--worker-threads 1): two test workers share the cores, and a
# forward whose threads wait for a busy core runs many times slower
ONE_THREAD = dict(worker_threads=1)


def shared_prefix_prompts(seed: int, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(4096) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
    return [
        rng.choice(systems) + [rng.randrange(4096) for _ in range(rng.randrange(1, 40))]
        for _ in range(n)
    ]


def dense_last_logits(prompt: list[int]) -> torch.Tensor:
    """One unchunked forward of the whole prompt on a private KV pool. The built-in model
    and the prompt fix the result, so each prompt's is computed once a test process (the
    same prompts are checked in every mode and page size)."""
    return _dense_last_logits(tuple(prompt))


@functools.cache
def _dense_last_logits(prompt: tuple[int, ...]) -> torch.Tensor:
    model = _builtin_model()
    kv = KVCache.for_model(model.config, len(prompt))
    fb = ForwardBatch.build([list(prompt)], [0], [list(range(len(prompt)))])
    with torch.inference_mode():
        return model(fb, kv)[0]


@functools.cache
def _builtin_model():
    return load_model(None)


@pytest.mark.parametrize("mode", LOCAL_MODES)
@pytest.mark.parametrize("page_size,chunk", [(1, 24), (16, 40), (4, -1)])
def test_modes_match_dense_and_drain_clean(mode, page_size, chunk):
    prompts = shared_prefix_prompts(1)
    with PrefillEngine(
        forward_mode=mode,
        page_size=page_size,
        chunked_prefill_size=chunk,
        max_prefill_tokens=96,
        check_invariants=True,
        **ONE_THREAD,
    ) as eng:
        outs = eng.prefill(prompts, return_logits=True)
        again = eng.prefill(prompts[:3], return_logits=True)  # all prefixes cached now
        eng.check_invariants(flush=True)
    for p, o in zip(prompts[:4], outs[:4]):
        ref = dense_last_logits(p)
        torch.testing.assert_close(o.logits, ref, atol=2e-4, rtol=1e-4)
        assert o.first_token == int(ref.argmax())
    for o, a in zip(outs[:3], again):
        assert a.first_token == o.first_token
        assert a.cached_tokens == (a.prompt_tokens - 1) // page_size * page_size
        torch.testing.assert_close(a.logits, o.logits, atol=2e-4, rtol=1e-4)


def test_long_prompts_finish_once_and_free_everything():
    prompts = [list(range(1, 300)), list(range(1, 200)) + [7] * 33, [5] * 517]
    with PrefillEngine(
        forward_mode="thread-ahead", page_size=16, chunked_prefill_size=64, check_invariants=True
    ) as eng:
        s = eng.scheduler
        finished = []
        s.reqs.on_finish = finished.append
        outs = eng.prefill(prompts)
        assert sorted(r.rid for r in finished) == sorted(o.rid for o in outs)  # once each
        assert all(r.inflight_middle_chunks == 0 for r in finished)
        assert s.metrics.num_batches >= sum(-(-len(p) // 64) for p in prompts) // 2
        eng.check_invariants(flush=True)
        assert s.allocator.available_size() == s.allocator.size
        assert s.req_pool.available_size() == s.req_pool.size


@pytest.mark.parametrize(
    "bad,match",
    [
        ([], "empty"),
        ([1, 2, 4096], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([1, 2.0], "token id 2.0 outside"),
        ([1, "x", 5000], "token id 'x' outside"),
        ([1] * 9000, "context length"),
    ],
)
def test_bad_input_is_refused_and_engine_stays_usable(bad, match):
    with PrefillEngine(forward_mode="overlap", max_total_tokens=2048) as eng:
        with pytest.raises(ValueError, match=match):
            eng.prefill([[1, 2, 3], bad])
        out = eng.prefill([[1, 2, 3]])
        assert out[0].prompt_tokens == 3
        eng.check_invariants(flush=True)


def test_prompt_longer_than_pool_is_refused():
    with PrefillEngine(forward_mode="normal", max_total_tokens=256, page_size=16) as eng:
        with pytest.raises(ValueError, match="KV pool"):
            eng.prefill([[1] * 300])
        assert eng.prefill([[1] * 200])[0].prompt_tokens == 200


def test_pool_smaller_than_workload_evicts_and_queues():
    prompts = shared_prefix_prompts(5, n=30)
    with PrefillEngine(
        forward_mode="thread-ahead",
        max_total_tokens=256,
        page_size=16,
        chunked_prefill_size=64,
        check_invariants=True,
    ) as eng:
        outs = eng.prefill(prompts)
        assert len(outs) == 30
        eng.check_invariants(flush=True)


def test_disabled_prefix_cache_computes_every_prompt_whole():
    prompts = shared_prefix_prompts(4, n=8)
    with PrefillEngine(forward_mode="proc-ahead", disable_radix_cache=True, **ONE_THREAD) as eng:
        outs = eng.prefill(prompts, return_logits=True)
        assert eng.scheduler.tree.total_size() == 0
        eng.check_invariants(flush=True)
    assert all(o.cached_tokens == 0 for o in outs)
    for o, p in zip(outs, prompts):
        torch.testing.assert_close(o.logits, dense_last_logits(p), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="needs the prefix cache"):
        PrefillEngine(disable_radix_cache=True, host_store_size=1024)
