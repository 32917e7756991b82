from __future__ import annotations

import json
import logging

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM, ModelConfig, load_model
from mpprefill.model.families import build_model
from mpprefill.model.loader import hf_name_table, hf_state_dict, load_hf_weights, read_config


def test_no_path_gives_the_seeded_tiny_model():
    a, b, c = load_model(None, seed=7), load_model(None, seed=7), load_model(None, seed=8)
    assert a.config == ModelConfig.tiny()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    assert 0.015 < a.layers[0].attention.wqkv.weight.std().item() < 0.025


def test_tiny_forward_of_2048_tokens():
    model = load_model(None)
    lens = [1, 255, 768, 1024]
    ids = [[(7 * r + j) % model.config.vocab_size for j in range(n)] for r, n in enumerate(lens)]
    starts = [sum(lens[:r]) for r in range(len(lens))]
    slots = [list(range(s, s + n)) for s, n in zip(starts, lens, strict=True)]
    kv = KVCache.for_model(model.config, sum(lens))
    logits = model(ForwardBatch.build(ids, [0] * len(lens), slots), kv)
    assert logits.shape == (4, model.config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0.05
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_missing_path_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def write_config(path, **changes) -> None:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
    }
    (path / "config.json").write_text(json.dumps({**hf, **changes}))


def test_no_safetensors_files(tmp_path):
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path))


@pytest.fixture
def checkpoint(tmp_path):
    """A one-layer checkpoint written from our own seeded model: (dir, HF tensors, model)."""
    safetensors = pytest.importorskip("safetensors.torch")
    write_config(tmp_path)
    ref = LlamaForCausalLM(read_config(str(tmp_path)))
    ref.init_random_weights(1)
    params = dict(ref.named_parameters())
    table = hf_name_table(ref.config).items()
    tensors = {hf: params[ours][rows].contiguous() for hf, (ours, rows) in table}
    safetensors.save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path), tensors, ref


def test_round_trip_through_hf_names(checkpoint):
    path, _, ref = checkpoint
    loaded = load_model(path).state_dict()
    for name, p in ref.state_dict().items():
        assert torch.equal(loaded[name], p), name


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(1)}), "unexpected"),
        (lambda t: t.pop("lm_head.weight"), "missing.*lm_head"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), "model.norm.weight"),
    ],
)
def test_weights_must_match_exactly(checkpoint, edit, match):
    path, tensors, _ = checkpoint
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        load_hf_weights(LlamaForCausalLM(read_config(path)), tensors)


def test_other_families_refuse_a_layer_past_theirs(checkpoint):
    path, tensors, _ = checkpoint
    tensors["model.layers.1.input_layernorm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match="unexpected.*model.layers.1.input_layernorm"):
        load_hf_weights(LlamaForCausalLM(read_config(path)), tensors)


# A two-layer DeepSeek-V3 (latent attention, a dense first layer, then 4 experts and a
# shared one), with one multi-token-prediction layer as its checkpoints declare it.
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "num_nextn_predict_layers": 1,
}


def deepseek_checkpoint(path, extra_layer: bool = True):
    """DEEPSEEK written from our own seeded model: (dir, HF tensors, model). With
    `extra_layer`, the checkpoint also holds layer 2 as DeepSeek's do their prediction
    layer: a copy of layer 1's tensors and the layer's own (eh_proj, enorm, hnorm, its
    head's norm)."""
    safetensors = pytest.importorskip("safetensors.torch")
    (path / "config.json").write_text(json.dumps(DEEPSEEK))
    ref = build_model(read_config(str(path)))
    ref.init_random_weights(1)
    tensors = hf_state_dict(ref)
    if extra_layer:
        last = "model.layers.1."
        extra = {
            n.replace(last, "model.layers.2."): t.clone() for n, t in tensors.items() if last in n
        }
        for name in ("enorm", "hnorm", "shared_head.norm"):
            extra[f"model.layers.2.{name}.weight"] = torch.ones(32)
        extra["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
        tensors |= extra
    safetensors.save_file(tensors, str(path / "model.safetensors"))
    return str(path), tensors, ref


def test_a_deepseek_checkpoints_prediction_layer_is_skipped(tmp_path, caplog):
    path, tensors, ref = deepseek_checkpoint(tmp_path)
    extra = [n for n in tensors if n.startswith("model.layers.2.")]
    assert len(extra) > 4 and len(tensors) - len(extra) == len(hf_name_table(ref.config))
    with caplog.at_level(logging.INFO, logger="mpprefill.model.loader"):
        loaded = load_model(path).state_dict()
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    want = f"skipped {len(extra)} checkpoint tensors of layers from 2 on (multi-token prediction)"
    assert skips == [want]
    for name, p in ref.state_dict().items():
        assert torch.equal(loaded[name], p), name


def test_a_deepseek_checkpoint_still_refuses_unknown_names_in_its_own_layers(tmp_path):
    path, tensors, ref = deepseek_checkpoint(tmp_path, extra_layer=False)
    for name in ("model.layers.1.bogus.weight", "model.layers.x.norm.weight", "model.extra"):
        with pytest.raises(ValueError, match=f"unexpected.*{name}"):
            load_hf_weights(ref, {**tensors, name: torch.zeros(1)})
