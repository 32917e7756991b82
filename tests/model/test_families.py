"""Every dense family from a checkpoint transformers wrote (random weights): its last-token
logits within 1e-3 relative of transformers' in float32 and its first tokens equal, through
the offline engine in normal and proc-ahead, over prompts that share prefixes (radix cache
hits), cross chunk boundaries and, for sliding layers, exceed the window."""

from __future__ import annotations

import random

import pytest
import torch

from mpprefill.engine import PrefillEngine
from mpprefill.model.config import SUPPORTED_ARCHITECTURES
from mpprefill.model.families import FAMILIES
from mpprefill.model.loader import read_config
from tests.model.test_hf_oracle import hf_last_logits, save, transformers

REL_ERR = 1e-3
WINDOW = 8
CHUNK = 16  # with page size 4: the longer prompts run in several chunks
DIMS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama3": ("Llama", dict(rope_parameters=LLAMA3)),
    "llama-yarn": ("Llama", dict(rope_parameters={**YARN, "rope_theta": 10000.0})),
    "llama-linear": ("Llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "mistral-swa": ("Mistral", dict(sliding_window=WINDOW, head_dim=24)),
    "mistral-full": ("Mistral", dict(sliding_window=None)),
    "qwen3-swa": (
        "Qwen3",
        dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3-bias": ("Qwen3", dict(head_dim=16, attention_bias=True)),
}
MOE = dict(num_experts_per_tok=2)
CASES.update(
    {
        "mixtral": ("Mixtral", dict(num_local_experts=4, **MOE)),
        "mixtral-swa": ("Mixtral", dict(num_local_experts=4, sliding_window=WINDOW, **MOE)),
        "qwen3-moe": (
            "Qwen3Moe",
            dict(num_experts=8, moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1], **MOE),
        ),
        "qwen3-moe-norm": (
            "Qwen3Moe",
            dict(num_experts=6, moe_intermediate_size=48, norm_topk_prob=True, **MOE),
        ),
    }
)
BOTH_MODES = ("llama3", "mistral-swa", "qwen3-swa", "mixtral", "qwen3-moe")


def hf_model(family: str, **changes):
    config = getattr(transformers, f"{family}Config")(**{**DIMS, **changes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor perturbed, norms around 1
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    return model


def prompt_sets(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two rounds: the second's prompts extend or branch off the first's (cache hits)."""
    rng = random.Random(0)
    words = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    base = words(40)
    first = [base, words(5), base[:13] + words(20), words(1)]
    second = [base + words(30), base[:24] + words(9), first[2] + words(3), words(66)]
    return first, second


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def check_against(reference, outs, prompts) -> None:
    for ids, out in zip(prompts, outs, strict=True):
        want = hf_last_logits(reference, ids)
        assert rel_err(out.logits, want) < REL_ERR, len(ids)
        assert out.first_token == int(want.argmax()), len(ids)


def serve_and_check(reference, path, mode: str, **engine) -> None:
    """Prompts, then prompts sharing their prefixes, through the engine in `mode` (and
    `engine`'s other settings): each last-token logits row against `reference` (a
    transformers model saved at `path`)."""
    first, second = prompt_sets(DIMS["vocab_size"])
    kw = dict(forward_mode=mode, page_size=4, chunked_prefill_size=CHUNK, check_invariants=True)
    kw |= engine
    with PrefillEngine(model_path=path, **kw) as eng:
        assert eng.model_config.architecture == type(reference).__name__
        check_against(reference, eng.prefill(first, return_logits=True), first)
        outs = eng.prefill(second, return_logits=True)
        check_against(reference, outs, second)
        assert sum(o.cached_tokens for o in outs) >= 40  # the prefixes came from the cache


def run_case(tmp_path, case: str, mode: str) -> None:
    family, changes = CASES[case]
    reference = hf_model(family, **changes)
    serve_and_check(reference, save(reference, tmp_path / case), mode)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers_in_normal(tmp_path, case):
    run_case(tmp_path, case, "normal")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", BOTH_MODES)
def test_family_matches_transformers_in_proc_ahead(tmp_path, case):
    run_case(tmp_path, case, "proc-ahead")


def test_sliding_layers_as_transformers_reads_them(tmp_path):
    mistral = read_config(save(hf_model("Mistral", sliding_window=WINDOW), tmp_path / "m"))
    assert mistral.sliding_window == WINDOW
    assert all(mistral.is_sliding(i) for i in range(DIMS["num_hidden_layers"]))
    qwen3 = read_config(save(hf_model("Qwen3", **CASES["qwen3-swa"][1]), tmp_path / "q"))
    assert (qwen3.head_size, qwen3.sliding_window) == (32, WINDOW)
    assert [qwen3.is_sliding(i) for i in range(3)] == [False, True, True]


def test_dynamic_rope_of_a_prompt_past_max_position_embeddings(tmp_path):
    """`dynamic` scales with the batch's longest sequence: one prompt at a time, unchunked,
    as transformers computes a lone sequence (--context-length lets it past the limit)."""
    reference = hf_model(
        "Llama", max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    path = save(reference, tmp_path)
    rng = random.Random(1)
    kw = dict(forward_mode="normal", page_size=4, chunked_prefill_size=-1, context_length=128)
    with PrefillEngine(model_path=path, **kw) as eng:
        for n in (20, 50, 90):
            ids = [rng.randrange(DIMS["vocab_size"]) for _ in range(n)]
            check_against(reference, eng.prefill([ids], return_logits=True), [ids])


def test_the_registry_holds_every_supported_architecture():
    assert tuple(FAMILIES) == SUPPORTED_ARCHITECTURES
    assert all(f.architecture == name for name, f in FAMILIES.items())
