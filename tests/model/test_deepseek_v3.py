"""DeepSeek-V3 from checkpoints transformers wrote (random weights, float32): latent
attention with and without q's low-rank projection, interleaved and halves-layout rope, YaRN
with mscale_all_dim, a dense first layer, shared experts and grouped routing (2 groups, 1
kept, a selection bias far from zero). Last-token logits within 1e-3 relative of
transformers' and first tokens equal for whole prompts in one batch, prefixes read back
from the latent pool beside a fresh request, a prompt over two chunks, and through the
offline engine in normal and proc-ahead; the same at two tensor-parallel ranks (heads split,
latent pool replicated); the latent pool's bytes per token; refusals."""

from __future__ import annotations

import random

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from mpprefill.model.families import config_from_hf
from mpprefill.model.parallel import TPRank, check_shardable, shard_config
from tests.model.test_families import DIMS as FAMILY_DIMS
from tests.model.test_families import rel_err, serve_and_check
from tests.model.test_hf_oracle import hf_last_logits, prompts, save, transformers
from tests.model.test_tensor_parallel import oracle
from tests.model.tp_ranks import run_ranks

REL_ERR = 1e-3
VOCAB = FAMILY_DIMS["vocab_size"]  # serve_and_check's prompts draw from it
DIMS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LATENT_DIM = 32 + 8  # kv_lora_rank + qk_rope_head_dim
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # the softmax scale grows by mscale(4, 0.8)^2 = 1.23
    "rope_theta": 10000.0,
}
VARIANTS = {
    "q-lora-yarn": dict(q_lora_rank=48, rope_parameters=YARN),
    "plain-q-halves": dict(
        q_lora_rank=None, rope_interleave=False, n_shared_experts=2, norm_topk_prob=False
    ),
}


def deepseek(**changes):
    config = transformers.DeepseekV3Config(**{**DIMS, **changes})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor perturbed, norms around 1
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # moves the choice of experts
                b.copy_(0.1 * torch.randn(b.shape))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple]:
    """Each variant's (transformers' model, its checkpoint directory, ours loaded from it)."""
    out = {}
    for name, changes in VARIANTS.items():
        reference = deepseek(**changes)
        path = save(reference, tmp_path_factory.mktemp(name))
        out[name] = (reference, path, load_model(path))
    return out


@pytest.fixture(params=list(VARIANTS))
def pair(request, checkpoints):
    return checkpoints[request.param]


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def forward(model, kv, new: list[list[int]], prefixes: list[int], slots: list[list[int]]):
    return model(ForwardBatch.build(new, prefixes, slots), kv)


def check(reference, got: torch.Tensor, ids: list[int]) -> None:
    want = hf_last_logits(reference, ids)
    assert rel_err(got, want) < REL_ERR, len(ids)
    assert int(got.argmax()) == int(want.argmax()), len(ids)


def test_whole_prompts_in_one_batch(pair):
    reference, _, ours = pair
    rng = random.Random(0)
    prompts = [words(rng, n) for n in (1, 7, 33, 64)]
    starts = [sum(len(p) for p in prompts[:r]) for r in range(len(prompts))]
    slots = [list(range(s, s + len(p))) for s, p in zip(starts, prompts, strict=True)]
    kv = KVCache.for_model(ours.config, starts[-1] + len(prompts[-1]))
    got = forward(ours, kv, prompts, [0] * len(prompts), slots)
    for row, ids in zip(got, prompts, strict=True):
        check(reference, row, ids)


def test_a_prefix_read_back_from_the_pool_beside_a_fresh_request(pair):
    """The second batch computes only the new tokens of `hit`; its 24 prefix tokens' keys
    exist only as the latent rows the first batch wrote."""
    reference, _, ours = pair
    rng = random.Random(1)
    first = words(rng, 40)
    kv = KVCache.for_model(ours.config, 160)
    forward(ours, kv, [first], [0], [list(range(40))])
    hit, fresh = first[:24] + words(rng, 9), words(rng, 5)
    slots = [list(range(24)) + list(range(100, 109)), list(range(120, 125))]
    got = forward(ours, kv, [hit[24:], fresh], [24, 0], slots)
    check(reference, got[0], hit)
    check(reference, got[1], fresh)


def test_a_prompt_over_two_chunks(pair):
    reference, _, ours = pair
    prompt = words(random.Random(2), 50)
    kv = KVCache.for_model(ours.config, 128)
    slots = list(range(127, 127 - 2 * len(prompt), -2))  # scattered, descending
    for start, end in ((0, 20), (20, len(prompt))):
        got = forward(ours, kv, [prompt[start:end]], [start], [slots[:end]])
        check(reference, got[0], prompt[:end])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["normal", "proc-ahead"])
def test_the_engine_matches_transformers(checkpoints, mode):
    """Prompts sharing prefixes (radix cache hits) over chunks, fake transfer backend."""
    reference, path, _ = checkpoints["q-lora-yarn"]
    serve_and_check(reference, path, mode)


def test_the_pool_holds_one_latent_row_per_token_and_layer():
    config = config_from_hf({**DIMS, "architectures": ["DeepseekV3ForCausalLM"]})
    layers = DIMS["num_hidden_layers"]
    for dtype in (torch.float32, torch.bfloat16):
        kv = KVCache.for_model(config, 16, dtype=dtype)
        assert kv.storage.shape == KVCache.model_storage_shape(config, 16)
        assert kv.storage.shape == (1, layers, 16, 1, LATENT_DIM)
        assert kv.bytes_per_slot == LATENT_DIM * layers * dtype.itemsize
    rows = torch.randn(3, LATENT_DIM)
    kv.write_latent(2, torch.tensor([5, 0, 9]), rows)
    torch.testing.assert_close(
        kv.gather(torch.tensor([5, 0, 9]))[0, 2, :, 0].float(), rows.bfloat16().float()
    )
    with pytest.raises(ValueError, match="no V"):
        kv.v(0)


@pytest.mark.timeout(300)
def test_two_tensor_parallel_ranks_match_transformers(checkpoints, tmp_path):
    """Both variants at TP 2 (gloo): whole prompts, a prompt over chunks and a prefix hit
    (`tp_ranks.scenario`); each rank's logits against transformers'."""
    ids = prompts(VOCAB)
    paths = {name: str(path) for name, (_, path, _) in checkpoints.items()}
    ranks = run_ranks(2, list(paths.values()), ids, str(tmp_path))
    for name, path in paths.items():
        reference = checkpoints[name][0]
        for key, want in oracle(reference, ids).items():
            for rank, results in enumerate(ranks):
                got = results[path][key]
                assert rel_err(got, want) < REL_ERR, (name, key, rank)
                assert torch.equal(got.argmax(-1), want.argmax(-1)), (name, key, rank)


@pytest.mark.timeout(180)
def test_the_engine_at_two_ranks_matches_transformers(checkpoints):
    """proc-ahead at TP 2, prefix hits over chunks: each rank computes half the heads and
    holds the whole latent pool."""
    reference, path, _ = checkpoints["plain-q-halves"]
    serve_and_check(reference, path, "proc-ahead", tp_size=2)


def test_a_rank_holds_its_heads_and_the_whole_latent_row():
    config = config_from_hf({**DIMS, "architectures": ["DeepseekV3ForCausalLM"]})
    ranks = [shard_config(config, TPRank(r, 2)) for r in range(2)]
    assert [c.num_attention_heads for c in ranks] == [2, 2]
    assert {c.kv_latent_dim for c in ranks} == {LATENT_DIM}
    assert {c.shared_expert_intermediate_size for c in ranks} == {16}
    for c in ranks:
        assert KVCache.model_storage_shape(c, 16) == KVCache.model_storage_shape(config, 16)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_shardable(config, 3)


def test_the_config_as_transformers_reads_it(pair):
    _, _, ours = pair
    config = ours.config
    assert (config.kv_lora_rank, config.head_size, config.kv_latent_dim) == (32, 8, LATENT_DIM)
    assert config.dense_mlp_layers == (0,) and config.num_experts == 8
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (2, 1, 2.5)
    shared = 2 if config.q_lora_rank is None else 1
    assert config.shared_expert_intermediate_size == 32 * shared
    assert config.rope_interleave == (config.q_lora_rank is not None)


HF = {**DIMS, "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": None}, "n_group"),
        ({"n_group": 3}, "n_group"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_unsupported_deepseek_fields_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**HF, **changes})
