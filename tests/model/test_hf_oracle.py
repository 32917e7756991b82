"""Logits of HF-saved Llama / Qwen2 checkpoints loaded here equal the transformers model's;
a bfloat16 checkpoint served in bfloat16 stays within bfloat16 noise of transformers running
it in bfloat16."""

from __future__ import annotations

import copy
import inspect
import json
import math
import random

import pytest
import torch

from mpprefill.engine import PrefillEngine
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from mpprefill.model.loader import read_config

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


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "DeepseekV2ForCausalLM"])
def test_unsupported_architecture_is_refused(tmp_path, arch):
    config = {**DIMS, "architectures": [arch], "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=arch) as err:
        load_model(str(tmp_path))
    assert "LlamaForCausalLM" in str(err.value)


# ---- bfloat16 ------------------------------------------------------------------------------

BF16_PROMPT_LENS = (1, 7, 20, 33, 47, 64, 90, 100)
BF16_CHUNK = 32  # the long prompts run in chunks over the bfloat16 pool
BF16_ULP_AT_1 = 2.0**-7  # bfloat16 keeps 8 significant bits: the spacing of values in [1, 2)


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory):
    """A random Qwen2 (every tensor perturbed) saved in bfloat16, and its directory. Only
    its parameters are cast, as `from_pretrained(dtype=torch.bfloat16)` loads them: the
    rotary buffer inv_freq stays float32 (`.to(torch.bfloat16)` would round it too)."""
    model = hf_model("Qwen2ForCausalLM")
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen2-bf16")
    return model, save(model, path)


def bf16_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(DIMS["vocab_size"]) for _ in range(n)] for n in BF16_PROMPT_LENS]


def served(path: str, **kw) -> tuple[list, str, torch.dtype]:
    """Every bfloat16 prompt through the offline engine: its outputs, the model's dtype and
    the KV pool's."""
    kw = dict(forward_mode="normal", chunked_prefill_size=BF16_CHUNK, **kw)
    with PrefillEngine(model_path=path, **kw) as eng:
        outs = eng.prefill(bf16_prompts(), return_logits=True)
        return outs, eng.model_config.dtype, eng.worker.kv_cache.dtype


def bf16_tolerance(logits: torch.Tensor) -> float:
    """Four bfloat16 ulps at the magnitude of the largest logit.

    Both sides compute in bfloat16 and round every op's output. Where two kernels sum in
    another order (our fused q|k|v and gate|up GEMMs, GQA heads taken by the attention
    kernel instead of repeated, a long prompt's chunks reading the pool, another CPU or
    library build) a value may round an ulp apart, and the logits end a few ulps of their
    own size apart (one ulp at |x| in [2, 4) is 2^-6). On this build they agree bit for
    bit. A wrong weight or a dropped term moves logits by whole units; a model that ran in
    float32 instead is caught by the dtypes asserted beside (transformers' own float32
    logits are 0.02-0.04 from its bfloat16 ones here, inside the bound).
    """
    octave = math.floor(math.log2(max(1.0, float(logits.abs().max()))))
    return 4 * BF16_ULP_AT_1 * 2.0**octave


def test_bfloat16_logits_match_transformers_in_bfloat16(hf_bf16):
    reference, path = hf_bf16
    assert read_config(path).dtype == "bfloat16"  # config.json says so
    outs, model_dtype, kv_dtype = served(path)  # auto: the checkpoint's bfloat16
    assert (model_dtype, kv_dtype) == ("bfloat16", torch.bfloat16)
    clear = 0
    for ids, out in zip(bf16_prompts(), outs, strict=True):
        want = hf_last_logits(reference, ids)
        atol = bf16_tolerance(want)
        assert out.logits.dtype == torch.float32  # logits leave the head as float32
        torch.testing.assert_close(out.logits, want, atol=atol, rtol=0)
        top2 = want.topk(2).values
        if top2[0] - top2[1] > 2 * atol:  # no pair of logits within atol can swap them
            assert out.first_token == int(want.argmax()), len(ids)
            clear += 1
    assert clear >= 2, "too few prompts with a clear greedy token to compare"


def test_bfloat16_checkpoint_served_in_float32_matches_transformers_upcast(hf_bf16):
    reference, path = hf_bf16
    upcast = copy.deepcopy(reference).float()  # the same weights, exactly, in float32
    outs, model_dtype, kv_dtype = served(path, dtype="float32")
    assert (model_dtype, kv_dtype) == ("float32", torch.float32)
    for ids, out in zip(bf16_prompts(), outs, strict=True):
        want = hf_last_logits(upcast, ids)
        torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
        assert out.first_token == int(want.argmax())
