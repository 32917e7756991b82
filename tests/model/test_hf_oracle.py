"""Logits of HF-saved Llama / Qwen2 checkpoints loaded here equal the transformers model's."""

from __future__ import annotations

import inspect
import json
import random

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model

transformers = pytest.importorskip(
    "transformers", reason="the HF oracle needs transformers (pip install transformers)"
)
pytest.importorskip("safetensors", reason="checkpoints are read with safetensors")

DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
)
PROMPT_LENS = (1, 7, 33, 64)
ATOL = 1e-4


def hf_model(arch: str, tie: bool = False):
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**DIMS, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval().float()
    with torch.no_grad():
        # Perturb every tensor, norms and zero-initialised biases included, so a swapped or
        # dropped weight shows in the logits.
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape))
    return model


def save(model, path) -> str:
    kwargs = {"max_shard_size": "100KB"}  # several shards, so all files are read
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def our_last_logits(model, ids: list[list[int]]) -> torch.Tensor:
    """One ragged batch, every prompt whole, slots laid out back to back."""
    starts = [sum(len(p) for p in ids[:r]) for r in range(len(ids))]
    slots = [list(range(s, s + len(p))) for s, p in zip(starts, ids, strict=True)]
    kv = KVCache.for_model(model.config, sum(len(p) for p in ids))
    return model(ForwardBatch.build(ids, [0] * len(ids), slots), kv)


@pytest.mark.parametrize(
    "arch, tie",
    [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", False), ("LlamaForCausalLM", True)],
)
def test_logits_match_transformers(tmp_path, arch, tie):
    reference = hf_model(arch, tie)
    ours = load_model(save(reference, tmp_path), seed=123)
    assert ours.config.architecture == arch
    assert ours.config.rope_theta == DIMS["rope_theta"]
    assert ours.config.tie_word_embeddings == tie
    ids = prompts(DIMS["vocab_size"])
    got = our_last_logits(ours, ids)
    for row, prompt in enumerate(ids):
        torch.testing.assert_close(got[row], hf_last_logits(reference, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_matches_transformers(tmp_path):
    reference = hf_model("Qwen2ForCausalLM")
    ours = load_model(save(reference, tmp_path))
    prompt = prompts(DIMS["vocab_size"])[-1]
    kv = KVCache.for_model(ours.config, 100 + len(prompt))
    slots = list(range(100, 100 + len(prompt)))
    for start, end in [(0, 20), (20, 21), (21, len(prompt))]:
        fb = ForwardBatch.build([prompt[start:end]], [start], [slots[:end]])
        got = ours(fb, kv)[0]
        torch.testing.assert_close(got, hf_last_logits(reference, prompt[:end]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MistralForCausalLM"])
def test_unsupported_architecture_is_refused(tmp_path, arch):
    config = {**DIMS, "architectures": [arch], "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=arch) as err:
        load_model(str(tmp_path))
    assert "LlamaForCausalLM" in str(err.value)
