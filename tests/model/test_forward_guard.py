"""The forward reads no device tensor back and issues a number of torch calls that does not
grow with the number of requests in its batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ForwardBatch, ModelConfig, build_model
from mpprefill.model.config import RopeScaling
from mpprefill.model.guard import DeviceRead, ForwardGuard, plain

SLOTS = 8192
# Torch calls one layer of the built-in model issues per forward, whatever the batch
# (61 when pinned; 136 at 4 x 256 and 1,156 at 64 x 16 with attention one request at a time).
MAX_CALLS_PER_LAYER = 64
MIXTRAL = {
    "architecture": "MixtralForCausalLM",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
}
QWEN3_MOE = {
    **MIXTRAL,
    "architecture": "Qwen3MoeForCausalLM",
    "head_dim": 64,
    "norm_topk_prob": False,
    "dense_mlp_layers": (1,),
}
GPT_OSS = {
    **MIXTRAL,
    "architecture": "GptOssForCausalLM",
    "head_dim": 64,
    "attention_bias": True,
    "attention_out_bias": True,
    "attention_sinks": True,
    "expert_bias": True,
    "swiglu_limit": 7.0,
    "sliding_window": 24,
    "layer_types": ("sliding_attention", "full_attention") * 2,
}

DEEPSEEK_V3 = {
    **MIXTRAL,
    "architecture": "DeepseekV3ForCausalLM",
    "num_key_value_heads": 8,
    "head_dim": 16,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "rope_interleave": True,
    "rope_scaling": RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=16, mscale_all_dim=1.0
    ),
    "moe_scoring": "sigmoid",
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "shared_expert_intermediate_size": 128,
    "dense_mlp_layers": (0,),
}


def model_of(layers: int = 4, **changes) -> tuple[CausalLM, KVCache]:
    cfg = dataclasses.replace(ModelConfig.tiny(), num_hidden_layers=layers, **changes)
    model = build_model(cfg)
    model.init_random_weights()
    return model, KVCache.for_model(cfg, SLOTS)


def batch(num_reqs: int, extend: int, prefix: int = 64, seed: int = 0) -> ForwardBatch:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(SLOTS, generator=gen)[: num_reqs * (prefix + extend)]
    ids = torch.randint(0, 4096, (num_reqs, extend), generator=gen)
    return ForwardBatch.build(ids.tolist(), [prefix] * num_reqs, slots.view(num_reqs, -1).tolist())


def guarded_forward(model, kv, fb) -> tuple[torch.Tensor, int]:
    guard = ForwardGuard()
    with guard.watch(fb) as marked:
        logits = plain(model(marked, kv))
    return logits, guard.calls


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.tolist(),
        lambda t: t.sum().item(),
        lambda t: bool((t < 0).any()),
        lambda t: int(t[0]),
        lambda t: t[t > 3],
        lambda t: t.nonzero(),
        lambda t: torch.repeat_interleave(t, t),
        lambda t: range(t.max()),
    ],
)
def test_the_guard_fails_a_read_of_the_batch_and_of_what_is_computed_from_it(read):
    guard = ForwardGuard()
    with guard.watch(batch(2, 3)) as fb, pytest.raises(DeviceRead):
        read(fb.extend_lens * 2)


def test_the_guard_lets_the_host_read_its_own_lengths_and_tensors():
    guard = ForwardGuard()
    with guard.watch(batch(2, 3)) as fb:
        assert fb.max_seq_len == 67 and fb.extend_lens_cpu == (3, 3)
        assert torch.tensor(fb.prefix_lens_cpu).tolist() == [64, 64]
        torch.repeat_interleave(fb.extend_lens, fb.extend_lens, output_size=6)
    assert guard.calls > 0


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": True, "attention_bias": True},
        {"sliding_window": 24, "layer_types": ("sliding_attention", "full_attention") * 2},
        {"architecture": "Qwen3ForCausalLM", "head_dim": 64},
        # the batch's 76 positions pass max_position_embeddings: a table of its own
        {"rope_scaling": RopeScaling("dynamic", 2.0), "max_position_embeddings": 64},
        {"rope_scaling": RopeScaling("yarn", 4.0, original_max_position_embeddings=16)},
        MIXTRAL,
        QWEN3_MOE,
        GPT_OSS,
        DEEPSEEK_V3,
    ],
    ids=[
        "plain",
        "tied-bias",
        "sliding",
        "qwen3",
        "dynamic",
        "yarn",
        "mixtral",
        "qwen3-moe",
        "gpt-oss",
        "deepseek-v3",
    ],
)
def test_a_forward_reads_no_device_tensor_and_the_guard_changes_nothing(changes):
    model, kv = model_of(**changes)
    fb = batch(5, 12)
    want = model(fb, kv)
    got, _ = guarded_forward(model, kv, fb)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"architecture": "Qwen3ForCausalLM", "head_dim": 64},
        MIXTRAL,
        QWEN3_MOE,
        GPT_OSS,
        DEEPSEEK_V3,
    ],
    ids=["llama", "qwen3", "mixtral", "qwen3-moe", "gpt-oss", "deepseek-v3"],
)
def test_calls_do_not_grow_with_the_requests_of_a_batch(changes):
    """64 x 16 new tokens and 4 x 256 (1,024 either way), each with 64 cached."""
    model, kv = model_of(**changes)
    _, many = guarded_forward(model, kv, batch(64, 16))
    _, few = guarded_forward(model, kv, batch(4, 256))
    assert many <= 1.15 * few


def test_calls_per_layer_stay_under_the_pinned_bound():
    counts = {}
    for layers in (4, 8):
        model, kv = model_of(layers)
        counts[layers] = guarded_forward(model, kv, batch(64, 16))[1]
    per_layer = (counts[8] - counts[4]) / 4
    assert 0 < per_layer <= MAX_CALLS_PER_LAYER, per_layer


def test_an_moe_layers_calls_do_not_grow_with_its_experts():
    """A model of only MoE layers issues as many calls with 64 experts as with 4."""
    counts = {}
    for experts in (4, 64):
        model, kv = model_of(**{**MIXTRAL, "num_experts": experts})
        counts[experts] = guarded_forward(model, kv, batch(8, 16))[1]
    assert counts[4] == counts[64]
