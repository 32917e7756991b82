"""load_model: the built-in tiny model, or an HF-style directory (config.json + *.safetensors)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from mpprefill.layer_configs import ModelSource
from mpprefill.model.config import ModelConfig, resolve_dtypes
from mpprefill.model.decoder import CausalLM
from mpprefill.model.families import build_model, config_from_hf, family
from mpprefill.model.parallel import ShardEntry, TPRank
from mpprefill.model.swa import with_sliding_window

logger = logging.getLogger(__name__)

# HF names that carry no weights of ours (old checkpoints store the rotary table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Families whose checkpoints carry multi-token-prediction layers after the forward's own
# (DeepSeek-V3's `num_nextn_predict_layers`, stored as model.layers.{num_hidden_layers}...):
# their tensors are skipped, as the prefill's forward never runs them.
_EXTRA_LAYER_FAMILIES = ("DeepseekV3ForCausalLM",)
_LAYER_PREFIX = "model.layers."


def load_model(
    model_path: str | None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    sliding_window: int | None = None,
    swa_layers: str | None = None,
    tp: TPRank | None = None,
    dtype: str = "auto",
) -> CausalLM:
    """None: ModelConfig.tiny() with seeded random weights. A path: an HF checkpoint of a
    family in the registry (`families/`).

    `sliding_window` / `swa_layers` (the flags) turn layers into sliding-window layers.
    With `tp` of several ranks: this rank's shard, read from the checkpoint alone (the
    random weights are those of the whole model, sharded). `dtype` (--dtype): the weights'
    and activations'; auto: the checkpoint's, float32 for the built-in model. Checkpoint
    tensors are cast to it as they are copied in, up or down.
    """
    config = _config(model_path, sliding_window, swa_layers, dtype)
    model = build_model(config, device=device, tp=tp)
    if model_path is None and model.tp is None:
        model.init_random_weights(seed)
        return model
    if model_path is None:
        whole = build_model(config)
        whole.init_random_weights(seed)
        load_tp_weights(model, hf_state_dict(whole))
        return model
    if model.tp is None:
        load_hf_weights(model, read_safetensors(model_path))
    else:
        load_tp_weights(model, SafetensorsShards(model_path))
    logger.info("loaded %s from %s", model.config.architecture, model_path)
    return model


def source_config(src: ModelSource) -> ModelConfig:
    """The config `src` names, sliding-window overrides and dtype applied, without
    weights."""
    return _config(src.model_path, src.sliding_window, src.swa_layers, src.dtype)


def _config(
    model_path: str | None, sliding_window: int | None, swa_layers: str | None, dtype: str
) -> ModelConfig:
    base = ModelConfig.tiny() if model_path is None else read_config(model_path)
    served = resolve_dtypes(dtype, "auto", base.dtype).model
    return with_sliding_window(dataclasses.replace(base, dtype=served), sliding_window, swa_layers)


def source_model(
    src: ModelSource, device: torch.device | str, tp: TPRank | None = None
) -> CausalLM:
    """The model `src` names, on `device` (this rank's shard with `tp`)."""
    return load_model(
        src.model_path,
        device=device,
        seed=src.random_seed,
        sliding_window=src.sliding_window,
        swa_layers=src.swa_layers,
        tp=tp,
        dtype=src.dtype,
    )


def read_config(model_path: str) -> ModelConfig:
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {model_path!r} is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in model path {model_path!r}")
    return config_from_hf(json.loads(config_file.read_text()))


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


def load_hf_weights(model: CausalLM, hf: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model's (fused) parameters; all must match exactly."""
    table = hf_name_table(model.config)
    _check_names(model.config, table, hf)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (ours, rows) in table.items():
            _copy(params[ours][rows], hf[name], name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """`src` into `dst`, cast to the model's dtype (a bfloat16 checkpoint served in float32
    is upcast exactly)."""
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def hf_name_table(config: ModelConfig) -> dict[str, tuple[str, slice]]:
    """HF tensor name -> (our parameter name, rows of it). Fused q|k|v and gate|up split by
    row: the shard table of a single rank, which holds every tensor whole."""
    table = tp_shard_table(config, TPRank(0, 1))
    return {name: (ours, rows) for name, (ours, rows, _, _) in table.items()}


def _check_names(config: ModelConfig, table: dict, names) -> None:
    extra = [n for n in names if _is_extra_layer(config, n)]
    if extra:
        logger.info(
            "skipped %d checkpoint tensors of layers from %d on (multi-token prediction)",
            len(extra),
            config.num_hidden_layers,
        )
    skip = set(extra)
    unexpected = [
        n for n in names if n not in table and n not in skip and not n.endswith(_IGNORED_SUFFIXES)
    ]
    if config.tie_word_embeddings:
        unexpected = [n for n in unexpected if n != "lm_head.weight"]
    missing = [n for n in table if n not in names]
    if unexpected or missing:
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")


def _is_extra_layer(config: ModelConfig, name: str) -> bool:
    """Whether `name` is a tensor of a layer past the forward's that `config`'s family
    stores in its checkpoints (`_EXTRA_LAYER_FAMILIES`)."""
    if config.architecture not in _EXTRA_LAYER_FAMILIES or not name.startswith(_LAYER_PREFIX):
        return False
    index = name[len(_LAYER_PREFIX) :].split(".", 1)[0]
    return index.isdigit() and int(index) >= config.num_hidden_layers


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """A whole (unsharded) model's weights under their HF names."""
    params = dict(model.named_parameters())
    return {
        hf: params[ours][rows].detach().contiguous().clone()
        for hf, (ours, rows) in hf_name_table(model.config).items()
    }


class SafetensorsShards:
    """The tensor names of a checkpoint directory; `read(name, rows, cols)` reads only that
    part of a tensor from its file."""

    def __init__(self, model_path: str):
        from safetensors import safe_open

        self._files = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                self._files.update(dict.fromkeys(h.keys(), str(f)))
        if not self._files:
            raise FileNotFoundError(f"no *.safetensors files in model path {model_path!r}")
        self._open = safe_open

    def __iter__(self):
        return iter(self._files)

    def read(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        with self._open(self._files[name], framework="pt") as h:
            part = h.get_slice(name)
            return _part(part, len(part.get_shape()), rows, cols)


class _WholeTensors:
    """In-memory tensors behind the same `read` as SafetensorsShards."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __iter__(self):
        return iter(self.tensors)

    def read(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        t = self.tensors[name]
        return _part(t, t.dim(), rows, cols)


def _part(t, dims: int, rows: slice, cols: slice):
    """A tensor's rows (and columns); of a 3-D one, a stack of experts, the rows and columns
    of every expert's matrix."""
    if dims == 1:
        return t[rows]
    return t[rows, cols] if dims == 2 else t[:, rows, cols]


def load_tp_weights(model: CausalLM, source: SafetensorsShards | dict[str, torch.Tensor]) -> None:
    """Copy this rank's part of each HF tensor into the sharded model's parameters."""
    if isinstance(source, dict):
        source = _WholeTensors(source)
    table = tp_shard_table(model.config, model.tp)
    _check_names(model.config, table, set(source))
    params = dict(model.named_parameters())
    with torch.no_grad():
        model.tok_embeddings.weight.zero_()  # the last rank's padding rows
        model.output.weight.zero_()
        for name, (ours, dst_rows, rows, cols) in table.items():
            _copy(params[ours][dst_rows], source.read(name, rows, cols), name)


def tp_shard_table(config: ModelConfig, tp: TPRank) -> dict[str, ShardEntry]:
    """HF tensor name -> where rank `tp.rank`'s part of it goes, as the config's family maps
    it (see `parallel.py`)."""
    return family(config.architecture).shard_table(config, tp)
