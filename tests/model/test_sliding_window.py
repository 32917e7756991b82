"""Sliding-window layers: same window boundary and logits as transformers computes them."""

from __future__ import annotations

import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, config_from_hf, load_model
from tests.model.test_hf_oracle import DIMS, hf_last_logits, prompts, save, transformers

WINDOW = 9


def qwen2_swa(max_window_layers: int = 1):
    config = transformers.Qwen2Config(
        **{**DIMS, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=max_window_layers,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    return model


def test_config_follows_transformers_rules():
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        **{**DIMS, "num_hidden_layers": 4},
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 2,
    }
    cfg = config_from_hf(hf)
    assert cfg.sliding_window == 16
    assert [cfg.is_sliding(i) for i in range(4)] == [False, False, True, True]
    hf["use_sliding_window"] = False  # Qwen2 ignores the window then, even with layer_types
    hf["layer_types"] = ["sliding_attention"] * 4
    assert not config_from_hf(hf).has_sliding_layers


def test_sliding_window_logits_match_transformers(tmp_path):
    reference = qwen2_swa()
    ours = load_model(save(reference, tmp_path))
    assert ours.config.sliding_window == WINDOW
    assert [ours.config.is_sliding(i) for i in range(3)] == [False, True, True]
    for prompt in prompts(DIMS["vocab_size"]):  # 1, 7 (inside the window), 33, 64 tokens
        kv = KVCache.for_model(ours.config, len(prompt))
        fb = ForwardBatch.build([prompt], [0], [list(range(len(prompt)))])
        torch.testing.assert_close(
            ours(fb, kv)[0], hf_last_logits(reference, prompt), atol=1e-4, rtol=0
        )


def test_chunked_prefill_respects_the_window(tmp_path):
    reference = qwen2_swa(max_window_layers=0)
    ours = load_model(save(reference, tmp_path))
    prompt = prompts(DIMS["vocab_size"])[-1]
    kv = KVCache.for_model(ours.config, len(prompt))
    for start, end in [(0, 5), (5, 30), (30, 31), (31, len(prompt))]:
        fb = ForwardBatch.build([prompt[start:end]], [start], [list(range(end))])
        torch.testing.assert_close(
            ours(fb, kv)[0], hf_last_logits(reference, prompt[:end]), atol=1e-4, rtol=0
        )
