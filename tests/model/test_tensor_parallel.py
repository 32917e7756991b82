"""Tensor parallel at 2 ranks (gloo, CPU): the same logits as one rank and as transformers,
for whole prompts, chunked prefill and prefix hits, sliding-window layers included."""

from __future__ import annotations

import pytest
import torch

from mpprefill.model import ModelConfig, load_model
from mpprefill.model.parallel import TPRank, check_shardable, shard_config
from tests.model.test_hf_oracle import DIMS, hf_last_logits, prompts, save, transformers
from tests.model.tp_ranks import run_ranks, scenario

REL_ERR = 1e-4
ODD_VOCAB = 251


def _perturbed(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    return model.eval().float()


def checkpoints():
    """A Llama with GQA (4 heads, 2 KV heads: one each), a Qwen2 with tied embeddings, one
    KV head (replicated on both ranks) and an odd vocabulary (a padded vocab shard), and
    a Qwen2 whose last two layers slide."""
    llama = transformers.LlamaConfig(**DIMS)
    tied = transformers.Qwen2Config(
        **{**DIMS, "vocab_size": ODD_VOCAB, "num_key_value_heads": 1}, tie_word_embeddings=True
    )
    swa = transformers.Qwen2Config(
        **{**DIMS, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=9,
        max_window_layers=1,
    )
    return {
        "llama-gqa": transformers.LlamaForCausalLM(llama),
        "qwen2-tied": transformers.Qwen2ForCausalLM(tied),
        "qwen2-swa": transformers.Qwen2ForCausalLM(swa),
    }


def oracle(reference, ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """What transformers computes for each forward of `tp_ranks.scenario`."""
    long = max(ids, key=len)
    out = {"whole": torch.stack([hf_last_logits(reference, p) for p in ids])}
    for end in (20, 21, len(long)):
        out[f"chunk{end}"] = hf_last_logits(reference, long[:end])[None]
    out["hit"] = torch.stack([hf_last_logits(reference, long), hf_last_logits(reference, long[:3])])
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.timeout(300)
def test_tp2_logits_equal_tp1_and_transformers(tmp_path):
    models = {name: _perturbed(m) for name, m in checkpoints().items()}
    paths = {name: save(m, tmp_path / name) for name, m in models.items()}
    ids = prompts(ODD_VOCAB)
    ranks = run_ranks(2, list(paths.values()), ids, str(tmp_path))
    for name, path in paths.items():
        tp1 = scenario(load_model(path), ids)
        want = oracle(models[name], ids)
        assert set(tp1) == set(want) == set(ranks[0][path])
        for key, ref in want.items():
            assert rel_err(tp1[key], ref) < REL_ERR, (name, key)
            for rank, results in enumerate(ranks):
                got = results[path][key]
                assert got.shape == ref.shape
                assert rel_err(got, tp1[key]) < REL_ERR, (name, key, rank)
                assert rel_err(got, ref) < REL_ERR, (name, key, rank)


@pytest.mark.timeout(120)
def test_tp2_builtin_model_matches_tp1(tmp_path):
    """The built-in model's random weights are the whole model's, sharded."""
    ids = prompts(ModelConfig.tiny().vocab_size)
    ranks = run_ranks(2, [None], ids, str(tmp_path))
    tp1 = scenario(load_model(None), ids)
    for key, want in tp1.items():
        assert rel_err(ranks[0][None][key], want) < REL_ERR, key
        assert torch.equal(ranks[0][None][key], ranks[1][None][key])


def test_shard_config_splits_heads_and_replicates_kv():
    cfg = ModelConfig(num_attention_heads=8, num_key_value_heads=2, intermediate_size=704)
    four = [shard_config(cfg, TPRank(r, 4)) for r in range(4)]
    assert {c.num_attention_heads for c in four} == {2}
    assert {c.num_key_value_heads for c in four} == {1}  # 2 KV heads over 4 ranks: replicated
    assert [TPRank(r, 4).kv_heads(cfg) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert four[0].head_size == cfg.head_size and four[0].intermediate_size == 176
    assert TPRank(1, 2).vocab(ModelConfig(vocab_size=251)) == range(126, 251)


@pytest.mark.parametrize(
    "kwargs, size, match",
    [
        (dict(num_attention_heads=8, num_key_value_heads=2), 3, "num_attention_heads"),
        (dict(hidden_size=384, num_attention_heads=12, num_key_value_heads=6), 3, "intermediate"),
        (dict(hidden_size=384, num_attention_heads=12, num_key_value_heads=3), 4, "key_value"),
        (
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30),
            4,
            "moe_intermediate_size",
        ),
    ],
)
def test_unshardable_models_are_refused(kwargs, size, match):
    with pytest.raises(ValueError, match=match):
        check_shardable(ModelConfig(**kwargs), size)


@pytest.mark.timeout(300)
def test_tp2_qwen3_matches_transformers(tmp_path):
    """Qwen3 at 2 ranks: its per-head q/k norms whole on each rank, an explicit head_dim,
    its last two layers sliding."""
    config = transformers.Qwen3Config(
        **{**DIMS, "num_hidden_layers": 3, "vocab_size": ODD_VOCAB},
        head_dim=32,
        use_sliding_window=True,
        sliding_window=9,
        max_window_layers=1,
    )
    reference = _perturbed(transformers.Qwen3ForCausalLM(config))
    path = save(reference, tmp_path / "qwen3")
    ids = prompts(ODD_VOCAB)
    ranks = run_ranks(2, [path], ids, str(tmp_path))
    for key, want in oracle(reference, ids).items():
        for rank, results in enumerate(ranks):
            assert rel_err(results[path][key], want) < REL_ERR, (key, rank)


def test_shard_config_splits_every_experts_rows():
    cfg = ModelConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96)
    shards = [shard_config(cfg, TPRank(r, 2)) for r in range(2)]
    assert {(c.num_experts, c.moe_intermediate_size) for c in shards} == {(8, 48)}
    assert TPRank(1, 2).moe_intermediate(cfg) == range(48, 96)


@pytest.mark.timeout(300)
def test_tp2_qwen3_moe_matches_transformers(tmp_path):
    """Qwen3-MoE at 2 ranks: every expert's rows split, the router whole on each rank, one
    dense layer (mlp_only_layers) split as a dense MLP, an odd vocabulary."""
    config = transformers.Qwen3MoeConfig(
        **{**DIMS, "num_hidden_layers": 3, "vocab_size": ODD_VOCAB},
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    reference = _perturbed(transformers.Qwen3MoeForCausalLM(config))
    path = save(reference, tmp_path / "qwen3-moe")
    ids = prompts(ODD_VOCAB)
    ranks = run_ranks(2, [path], ids, str(tmp_path))
    for key, want in oracle(reference, ids).items():
        for rank, results in enumerate(ranks):
            assert rel_err(results[path][key], want) < REL_ERR, (key, rank)
