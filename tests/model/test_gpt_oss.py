"""gpt-oss from checkpoints transformers wrote (random weights, sinks far from zero, a small
SwiGLU limit so the clamp bites): last-token logits within 1e-3 relative of transformers'
in float32 and first tokens equal, through the offline engine in normal and proc-ahead,
over prompts that share prefixes, cross chunks and exceed the sliding window, and at TP 2
(gloo); its experts against a loop over tokens; its config as transformers reads it, and
refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mpprefill.model import ModelConfig
from mpprefill.model.families import config_from_hf
from mpprefill.model.layers.moe import SparseMoE
from mpprefill.model.loader import read_config
from tests.model.test_families import DIMS, WINDOW, hf_model, serve_and_check
from tests.model.test_hf_oracle import DIMS as TP_DIMS
from tests.model.test_hf_oracle import prompts, save, transformers
from tests.model.test_tensor_parallel import REL_ERR, oracle, rel_err
from tests.model.tp_ranks import run_ranks

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
    "rope_theta": 150000.0,
}
CHANGES = dict(
    num_hidden_layers=4,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    swiglu_limit=0.5,
    rope_parameters=YARN,
)
HF = {**DIMS, "architectures": ["GptOssForCausalLM"], **CHANGES}


def gpt_oss(**changes):
    model = hf_model("GptOss", **{**CHANGES, **changes})
    with torch.no_grad():
        for layer in model.model.layers:  # sinks of either sign, some outweighing the keys
            layer.self_attn.sinks.copy_(2.0 * torch.randn(layer.self_attn.sinks.shape))
    return model


def run(tmp_path, mode: str, **changes) -> None:
    reference = gpt_oss(**changes)
    serve_and_check(reference, save(reference, tmp_path / "gpt-oss"), mode)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["normal", "proc-ahead"])
def test_gpt_oss_matches_transformers(tmp_path, mode):
    run(tmp_path, mode)


@pytest.mark.timeout(180)
def test_gpt_oss_of_full_layers_only_and_no_biases(tmp_path):
    run(tmp_path, "normal", layer_types=["full_attention"] * 4, attention_bias=False)


def test_gpt_oss_reads_its_config_as_transformers(tmp_path):
    config = read_config(save(gpt_oss(), tmp_path))
    assert [config.is_sliding(i) for i in range(4)] == [True, False, True, False]
    assert config.sliding_window == WINDOW and config.head_size == 16
    assert (config.num_experts, config.moe_intermediate_size) == (4, 32)
    assert config.attention_sinks and config.expert_bias and config.swiglu_limit == 0.5
    assert config.rope_theta == 150000.0 and not config.rope_scaling.truncate
    bare = config_from_hf({k: v for k, v in HF.items() if k != "rope_parameters"})
    assert bare.rope_theta == 150000.0 and bare.rope_scaling.factor == 32.0


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_local_experts": None}, "num_local_experts"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, "longrope"),
    ],
)
def test_unsupported_gpt_oss_fields_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**HF, **changes})


def experts(grouped: bool) -> SparseMoE:
    config = dataclasses.replace(
        ModelConfig.tiny(),
        hidden_size=64,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        expert_bias=True,
        swiglu_limit=1.0,
        swiglu_alpha=1.702,
    )
    m = SparseMoE(config, grouped=grouped, stacked=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


def per_token(m: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts one token at a time: softmax over the top-k biased logits, gate
    and up interleaved, the clamped SwiGLU."""
    logits = F.linear(x, m.router.weight, m.router.bias)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top, chosen = logits[t].topk(m.top_k)
        for w, e in zip(top.softmax(-1).tolist(), chosen.tolist(), strict=True):
            gate_up = x[t] @ m.w13[e] + m.b13[e]
            gate = gate_up[::2].clamp(max=m.limit)
            up = gate_up[1::2].clamp(-m.limit, m.limit)
            h = (up + 1) * gate * torch.sigmoid(m.alpha * gate)
            out[t] += w * (h @ m.w2[e] + m.b2[e])
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dense"])
def test_the_experts_match_a_loop_over_tokens(grouped):
    m = experts(grouped)
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m(x), per_token(m, x), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_tp2_gpt_oss_matches_transformers(tmp_path):
    """gpt-oss at 2 ranks (gloo): each rank's heads of the sinks, its run of columns of the
    interleaved gate_up, its rows of down, the down bias added once."""
    changes = {**CHANGES, "sliding_window": 9, "rope_parameters": {**YARN, "rope_theta": 5e4}}
    config = transformers.GptOssConfig(**{**TP_DIMS, "num_hidden_layers": 2, **changes})
    torch.manual_seed(0)
    reference = transformers.GptOssForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            scale = 2.0 if name.endswith("sinks") else 0.1
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape))
    path = save(reference, tmp_path / "gpt-oss")
    ids = prompts(TP_DIMS["vocab_size"])
    ranks = run_ranks(2, [path], ids, str(tmp_path))
    for key, want in oracle(reference, ids).items():
        for rank, results in enumerate(ranks):
            assert rel_err(results[path][key], want) < REL_ERR, (key, rank)
