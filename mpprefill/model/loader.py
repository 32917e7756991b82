"""load_model: the built-in tiny model, or an HF-style directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mpprefill.model.config import ModelConfig
from mpprefill.model.llama import LlamaForCausalLM
from mpprefill.model.swa import with_sliding_window

if TYPE_CHECKING:
    from mpprefill.config import ServerArgs

logger = logging.getLogger(__name__)

# HF names that carry no weights of ours (old checkpoints store the rotary table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_path: str | None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    swa_layers: str | None = None,
) -> LlamaForCausalLM:
    """None: ModelConfig.tiny() with seeded random weights. A path: an HF Llama/Qwen2 checkpoint.

    `sliding_window` / `swa_layers` (the flags) turn layers into sliding-window layers.
    """
    model = LlamaForCausalLM(_config(model_path, sliding_window, swa_layers), device=device)
    if model_path is None:
        model.init_random_weights(seed)
        return model
    load_hf_weights(model, read_safetensors(model_path))
    logger.info("loaded %s from %s", model.config.architecture, model_path)
    return model


def config_from_args(args: ServerArgs) -> ModelConfig:
    """The config the server's flags name, sliding-window flags applied, without weights."""
    return _config(args.model_path, args.sliding_window, args.swa_layers)


def _config(model_path: str | None, sliding_window: int | None, swa_layers: str | None):
    base = ModelConfig.tiny() if model_path is None else read_config(model_path)
    return with_sliding_window(base, sliding_window, swa_layers)


def model_from_args(args: ServerArgs, device: torch.device | str) -> LlamaForCausalLM:
    """The model the server's flags name, on `device`."""
    return load_model(
        args.model_path,
        device=device,
        seed=args.random_seed,
        sliding_window=args.sliding_window,
        swa_layers=args.swa_layers,
    )


def read_config(model_path: str) -> ModelConfig:
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {model_path!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model path {model_path!r}")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def read_safetensors(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of all *.safetensors files in the directory, on the CPU."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:
        raise ImportError(
            "loading a checkpoint needs safetensors: pip install 'mpprefill[hf]'"
        ) from e
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model path {model_path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_hf_weights(model: LlamaForCausalLM, hf: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model's (fused) parameters; all must match exactly."""
    table = hf_name_table(model.config)
    unexpected = [n for n in hf if n not in table and not n.endswith(_IGNORED_SUFFIXES)]
    if model.config.tie_word_embeddings:
        unexpected = [n for n in unexpected if n != "lm_head.weight"]
    missing = [n for n in table if n not in hf]
    if unexpected or missing:
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (ours, rows) in table.items():
            _copy(params[ours][rows], hf[name], name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)


def hf_name_table(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """HF tensor name -> (our parameter name, rows of it). Fused q|k|v and gate|up split by row."""
    table = {
        "model.embed_tokens.weight": ("tok_embeddings.weight", slice(None)),
        "model.norm.weight": ("norm.weight", slice(None)),
    }
    if not config.tie_word_embeddings:
        table["lm_head.weight"] = ("output.weight", slice(None))
    for i in range(config.num_hidden_layers):
        table.update(_layer_table(config, i))
    return table


def _layer_table(config: ModelConfig, i: int) -> dict[str, tuple[str, slice]]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, None)}
    suffixes = ("weight", "bias") if config.attention_bias else ("weight",)
    table = {
        f"{hf}self_attn.{proj}.{s}": (f"{ours}attention.wqkv.{s}", rows)
        for proj, rows in qkv_rows.items()
        for s in suffixes
    }
    whole = slice(None)
    table[f"{hf}self_attn.o_proj.weight"] = (f"{ours}attention.wo.weight", whole)
    if config.attention_out_bias:
        table[f"{hf}self_attn.o_proj.bias"] = (f"{ours}attention.wo.bias", whole)
    table[f"{hf}mlp.gate_proj.weight"] = (f"{ours}feed_forward.w13.weight", slice(0, inter))
    table[f"{hf}mlp.up_proj.weight"] = (f"{ours}feed_forward.w13.weight", slice(inter, None))
    table[f"{hf}mlp.down_proj.weight"] = (f"{ours}feed_forward.w2.weight", whole)
    table[f"{hf}input_layernorm.weight"] = (f"{ours}attention_norm.weight", whole)
    table[f"{hf}post_attention_layernorm.weight"] = (f"{ours}ffn_norm.weight", whole)
    return table
