"""A sliding-window Qwen2 with the host KV store through every forward mode: pass two's
prompts hit host pages past the window (full KV only there, full and SWA KV inside it),
and the logits equal those of the run without a store and of transformers."""

from __future__ import annotations

import json
import random

import pytest
import torch

from mpprefill.config import FORWARD_MODES
from mpprefill.engine import PrefillEngine
from tests.model.test_hf_oracle import DIMS, hf_last_logits, save, transformers

pytestmark = pytest.mark.timeout(600)
WINDOW, SYSTEM_LEN, NUM_SYSTEMS = 9, 40, 4
ENGINE_KW = dict(
    page_size=4,
    chunked_prefill_size=16,
    max_total_tokens=160,  # about three prompts: pass two finds little on the device
    check_invariants=True,
    # NOTE: one torch thread: two test workers share the cores, and a forward whose
    # threads wait for a busy core runs many times slower
    worker_threads=1,
)


def qwen2_swa(tmp_path, layer_types: bool):
    """A 3-layer Qwen2 whose layers 0, 2 slide (`layer_types`), or 1, 2 (as
    `use_sliding_window` and `max_window_layers` derive them, no `layer_types` saved)."""
    kw = dict(use_sliding_window=True, sliding_window=WINDOW)
    if layer_types:
        kw["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    else:
        kw["max_window_layers"] = 1
    config = transformers.Qwen2Config(**{**DIMS, "num_hidden_layers": 3}, **kw)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    path = save(model, tmp_path)
    if not layer_types:
        cfg_file = tmp_path / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.pop("layer_types", None)  # as older transformers wrote it
        cfg_file.write_text(json.dumps(cfg))
    return model, path


def two_passes(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Pass one: each system prompt twice; pass two: fresh questions and one repeat."""
    rng = random.Random(seed)
    vocab = DIMS["vocab_size"]
    systems = [[rng.randrange(vocab) for _ in range(SYSTEM_LEN)] for _ in range(NUM_SYSTEMS)]

    def ask(s: list[int]) -> list[int]:
        return s + [rng.randrange(vocab) for _ in range(rng.randrange(3, 14))]

    first = [ask(s) for s in systems for _ in range(2)]
    return first, [ask(s) for s in systems] + [first[1]]


def run(mode: str, path: str, **kw):
    first, second = two_passes()
    with PrefillEngine(model_path=path, forward_mode=mode, **ENGINE_KW, **kw) as eng:
        s = eng.scheduler
        assert s.allocator.has_swa_pool
        eng.prefill(first, return_logits=True)
        if s.host_tier is not None:
            s.host_tier.retire(wait=True)  # pass one's write-backs are matchable now
        outs = eng.prefill(second, return_logits=True)
        if s.host_tier is not None:
            s.host_tier.retire(wait=True)
            s.host_tier.check()
        eng.check_invariants(flush=True)
        return second, outs, s.metrics


@pytest.fixture(scope="module", params=[True, False], ids=["layer_types", "max_window_layers"])
def model(request, tmp_path_factory):
    reference, path = qwen2_swa(tmp_path_factory.mktemp("qwen2swa"), request.param)
    _, no_store, _ = run("normal", path)
    prompts = two_passes()[1]
    return request.param, reference, path, no_store, [hf_last_logits(reference, p) for p in prompts]


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_host_hits_past_the_window_match_no_store_and_transformers(mode, model):
    layer_types, _, path, no_store, hf = model
    if not layer_types and mode not in ("normal", "proc-ahead"):
        pytest.skip("the max_window_layers config runs in two modes; layer_types in all")
    _, outs, metrics = run(mode, path, host_store_size=4096)
    assert metrics.host_loaded_tokens > 0 and metrics.host_written_tokens > 0
    aligned = SYSTEM_LEN - SYSTEM_LEN % ENGINE_KW["page_size"]
    assert all(o.cached_tokens >= aligned for o in outs)  # the device alone had fewer
    assert sum(o.cached_tokens for o in outs) > sum(o.cached_tokens for o in no_store)
    assert aligned > WINDOW  # a hit crosses the window: pages before it carry full KV only
    for o, ref, want in zip(outs, no_store, hf, strict=True):
        torch.testing.assert_close(o.logits, ref.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o.logits, want, atol=1e-4, rtol=0)
        assert o.first_token == ref.first_token
