"""A sliding-window model through the whole engine: six modes, a small SWA pool, prefix hits."""

from __future__ import annotations

import random

import pytest
import torch

from mpprefill.config import FORWARD_MODES
from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model

pytestmark = pytest.mark.timeout(300)
SWA = dict(sliding_window=16, swa_layers="sf")
ENGINE_KW = dict(
    page_size=4,
    chunked_prefill_size=16,
    max_prefill_tokens=32,
    max_running_requests=4,
    max_total_tokens=1024,
    swa_full_tokens_ratio=0.06,  # 15 pages of 4: less than one long prompt
    check_invariants=True,
    **SWA,
)
# NOTE: one torch thread on the CPU (not in ENGINE_KW, which the GPU test shares): two test
# workers share the cores, and a forward whose threads wait for a busy core runs many
# times slower
ONE_THREAD = dict(worker_threads=1)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    systems = [[rng.randrange(4096) for _ in range(n)] for n in (40, 70)]
    out = [rng.choice(systems) + [rng.randrange(4096) for _ in range(rng.randrange(1, 30))]]
    for _ in range(9):
        out.append(rng.choice(systems) + [rng.randrange(4096) for _ in range(rng.randrange(1, 30))])
    out.append([rng.randrange(4096) for _ in range(120)])  # longer than the SWA pool
    return out + out[:3]  # repeats: whole-prompt hits


@pytest.fixture(scope="module")
def dense():
    """Last-token logits of one dense forward per prompt (every key kept, masks by window)."""
    model = load_model(None, **SWA)
    out = []
    for p in prompts():
        kv = KVCache.for_model(model.config, len(p))
        with torch.inference_mode():
            out.append(model(ForwardBatch.build([p], [0], [list(range(len(p)))]), kv)[0])
    return out


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_every_mode_matches_the_dense_sliding_window_reference(mode, dense):
    with PrefillEngine(forward_mode=mode, **ENGINE_KW, **ONE_THREAD) as eng:
        swa = eng.scheduler.allocator.swa
        assert swa.size < 120  # the long prompt only fits because the window moves on
        outs = eng.prefill(prompts(), return_logits=True)
        eng.check_invariants(flush=False)
        tree = eng.scheduler.tree
        assert tree.swa_total_size() < tree.total_size()  # some cached pages left the window
        eng.check_invariants(flush=True)
    for o, ref in zip(outs, dense):
        torch.testing.assert_close(o.logits, ref, atol=1e-4, rtol=1e-4)
        assert o.first_token == int(ref.argmax())
    assert sum(o.cached_tokens for o in outs) > 0


def test_freeing_out_of_window_pages_at_once_keeps_logits(dense):
    kw = {**ENGINE_KW, **ONE_THREAD}
    with PrefillEngine(forward_mode="proc-ahead", swa_free_out_of_window=True, **kw) as eng:
        outs = eng.prefill(prompts(), return_logits=True)
        eng.check_invariants(flush=True)
    for o, ref in zip(outs, dense):
        torch.testing.assert_close(o.logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["normal", "thread-ahead", "proc-ahead"])
def test_without_a_prefix_cache(mode, dense):
    kw = {**ENGINE_KW, **ONE_THREAD, "disable_radix_cache": True}
    with PrefillEngine(forward_mode=mode, **kw) as eng:
        outs = eng.prefill(prompts(), return_logits=True)
        assert eng.scheduler.tree.total_size() == 0
        eng.check_invariants(flush=True)
    for o, ref in zip(outs, dense):
        torch.testing.assert_close(o.logits, ref, atol=1e-4, rtol=1e-4)
    assert sum(o.cached_tokens for o in outs) == 0
