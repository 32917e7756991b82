"""The models an emulated accelerator runs, as shapes: `ModelShape` (the dimensions a
roofline needs: layers, widths, experts, sliding and latent attention, bytes per element),
read from a config.json or named as a preset, and how many kernels each of its layers
launches. `roofline.py` charges a shape's work on a GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A layer's attention part (`roofline.layer_kernels`): input norm, qkv, rope, KV write, attention,
# o_proj, post-attention norm.
ATTENTION_KERNELS = 7
# Latent attention's: input norm, the q and latent down projection, their norms, q's up
# projection, rope, the latent write, the gather of every key's latent row, kv_b's up
# projection, K's assembly, attention, o_proj, post-attention norm.
LATENT_ATTENTION_KERNELS = 12
# A dense MLP: gate_up, act, down.
MLP_KERNELS = 3
# An MoE MLP: the router, top-k, the sort by expert, the group offsets, the gather of
# routed rows, grouped gate_up, act, grouped down, the scaling by route weight and the sum
# back to the tokens (shared experts add a dense MLP's three).
MOE_KERNELS = 10
KERNELS_PER_LAYER = ATTENTION_KERNELS + MLP_KERNELS
KERNELS_PER_MOE_LAYER = ATTENTION_KERNELS + MOE_KERNELS
# Gather of the last positions, final norm, LM head GEMM.
KERNELS_PER_HEAD = 3
CONFIG_NAME = "config.json"
# The emulated models' own dtype, presets and config.json files alike: what --dtype auto
# and --kv-cache-dtype auto charge (ModelShape's bytes per element).
EMULATED_DTYPE = "bfloat16"


# ModelShape's fields that may be zero or empty (a dense model's) or are not counts.
_NOT_POSITIVE = frozenset(
    (
        "name",
        "num_experts",
        "experts_per_tok",
        "moe_intermediate",
        "sparse_step",
        "dense_layers",
        "sliding_window",
        "sliding_layers",
        "shared_intermediate",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
    )
)
# A config.json's name for a layer that attends only to its last `sliding_window` positions.
SLIDING_TYPE = "sliding_attention"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2  # weights and activations
    name: str = ""
    kv_dtype_bytes: int = 2  # the KV pool's elements
    # Mixture of experts (none: a dense model). Layer i routes each token to
    # `experts_per_tok` of `num_experts` experts of `moe_intermediate` rows unless i is in
    # `dense_layers` or i + 1 is not a multiple of `sparse_step` (Qwen3-MoE's rule); those
    # layers keep a dense MLP of `intermediate` rows.
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    # Sliding-window attention (none: every layer attends to all positions): the layers in
    # `sliding_layers` attend to their last `sliding_window` positions.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # Shared experts (DeepSeek's): a dense MLP of `shared_intermediate` rows that every token
    # of a sparse layer runs beside its routed experts (0: none).
    shared_intermediate: int = 0
    # Multi-head latent attention (none: attention over `num_kv_heads` K and V heads): a
    # token keeps one row of `kv_lora_rank` + `head_dim` (the rope key) a layer, from which
    # every head's K (`qk_nope_head_dim` + `head_dim`) and V (`v_head_dim`) are
    # decompressed; q goes down to `q_lora_rank` and back up to every head.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        for key in (f.name for f in dataclasses.fields(self) if f.name not in _NOT_POSITIVE):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name or 'model'}: {key} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name or 'model'}: heads not a multiple of kv heads")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        self._check_experts()
        self._check_sliding()
        self._check_latent()

    def _check_experts(self) -> None:
        who = self.name or "model"
        e, k = self.num_experts, self.experts_per_tok
        if e == 0:
            extra = self.moe_intermediate or self.dense_layers or self.shared_intermediate
            if k or extra or self.sparse_step != 1:
                raise ValueError(f"{who}: expert fields without experts")
            return
        if e < 0 or not 0 < k <= e:
            raise ValueError(f"{who}: experts_per_tok ({k}) must be in 1..num_experts ({e})")
        if self.moe_intermediate <= 0 or self.sparse_step <= 0 or self.shared_intermediate < 0:
            raise ValueError(
                f"{who}: moe_intermediate and sparse_step must be positive, shared_intermediate"
                " not negative"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{who}: dense_layers {bad} are not layers of {self.num_layers}")

    def _check_sliding(self) -> None:
        who = self.name or "model"
        if self.sliding_window < 0 or bool(self.sliding_window) != bool(self.sliding_layers):
            raise ValueError(f"{who}: sliding_window and sliding_layers go together")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{who}: sliding_layers {bad} are not layers of {self.num_layers}")

    def _check_latent(self) -> None:
        who = self.name or "model"
        dims = (self.q_lora_rank, self.qk_nope_head_dim, self.v_head_dim)
        if self.kv_lora_rank == 0:
            if any(dims):
                raise ValueError(f"{who}: latent attention fields without kv_lora_rank")
            return
        if self.kv_lora_rank < 0 or min(dims) <= 0:
            raise ValueError(
                f"{who}: kv_lora_rank, q_lora_rank, qk_nope_head_dim and v_head_dim must be"
                " positive (the roofline charges q's low-rank projection only)"
            )
        if self.num_kv_heads != self.num_heads or self.sliding_layers:
            raise ValueError(f"{who}: latent attention has a K and V per head and no window")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends only to its last `sliding_window` positions."""
        return layer in self.sliding_layers

    def kernels_in_layer(self, layer: int) -> int:
        """Kernels layer `layer` launches in the roofline: its attention's (latent or not)
        and its MLP's (sparse, with or without shared experts, or dense)."""
        attention = LATENT_ATTENTION_KERNELS if self.is_latent else ATTENTION_KERNELS
        if not self.is_sparse(layer):
            return attention + MLP_KERNELS
        return attention + MOE_KERNELS + (MLP_KERNELS if self.shared_intermediate else 0)

    @property
    def kernels_per_forward(self) -> int:
        """Kernels a forward launches: every layer's and the head's."""
        return KERNELS_PER_HEAD + sum(self.kernels_in_layer(i) for i in range(self.num_layers))

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        if self.num_experts == 0 or layer in self.dense_layers:
            return False
        return (layer + 1) % self.sparse_step == 0

    @property
    def is_latent(self) -> bool:
        """Multi-head latent attention (see `kv_lora_rank`)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A head's q and k width: under latent attention its unrotated part and the rope
        key, else `head_dim`."""
        return self.qk_nope_head_dim + self.head_dim

    @property
    def latent_width(self) -> int:
        """Elements of a token's latent row in one layer: the latent and the rope key."""
        return self.kv_lora_rank + self.head_dim

    @property
    def q_width(self) -> int:
        return self.num_heads * self.qk_head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer, with GQA widths; under latent attention q's and the
        latent's down projections, q's up projection, kv_b and o."""
        if not self.is_latent:
            return self.hidden * (2 * self.q_width + 2 * self.kv_width)
        down = self.hidden * (self.q_lora_rank + self.latent_width)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * self.hidden
        return down + self.q_lora_rank * self.q_width + kv_b + o

    @property
    def params_per_layer(self) -> int:
        """Linear weights of one dense layer: q, k, v, o and gate, up, down."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """gate, up and down of one expert."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def layer_weight_bytes(self) -> int:
        return self.params_per_layer * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer (its latent row under latent attention)."""
        if self.is_latent:
            return self.latent_width * self.kv_dtype_bytes
        return 2 * self.kv_width * self.kv_dtype_bytes

    def shard(self, tp: int) -> ModelShape:
        """One rank's shape at tensor parallel `tp`: its heads, KV heads (one, replicated,
        below `tp` KV heads), MLP and shared experts' rows and vocabulary slice. Latent
        attention's down projections and latent rows stay whole on every rank."""
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
        if tp == 1:
            return self
        kv = self.num_kv_heads
        mlps = self.intermediate % tp or self.moe_intermediate % tp or self.shared_intermediate % tp
        if self.num_heads % tp or mlps or (kv % tp if kv >= tp else tp % kv):
            raise ValueError(f"{self.name or 'model'}: its heads and MLP do not split over {tp}")
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // tp,
            num_kv_heads=max(1, kv // tp),
            intermediate=self.intermediate // tp,
            moe_intermediate=self.moe_intermediate // tp,
            shared_intermediate=self.shared_intermediate // tp,
            vocab=math.ceil(self.vocab / tp),
        )

    @classmethod
    def from_hf_config(cls, config: str | os.PathLike | Mapping[str, Any]) -> ModelShape:
        """A shape from a Hugging Face config.json: a path to it, its directory, or its dict."""
        if isinstance(config, Mapping):
            return _shape_from_dict(config, name=str(config.get("_name_or_path", "")))
        path = _config_path(Path(config))
        return _shape_from_dict(_load_json(path), name=path.parent.name)


def _config_path(path: Path) -> Path:
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"no model config at {path}")
    return path


def _load_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _shape_from_dict(config: Mapping[str, Any], name: str) -> ModelShape:
    # Multimodal configs keep the language model's dimensions under text_config.
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    hidden = _int_field(config, "hidden_size")
    heads = _int_field(config, "num_attention_heads")
    latent = _latent_fields(config)
    if config.get("head_dim") is None and hidden % heads and not latent:
        raise ValueError(f"hidden_size {hidden} is not a multiple of {heads} heads")
    intermediate = _int_field(config, "intermediate_size")
    layers = _int_field(config, "num_hidden_layers")
    if latent:  # the rotated part of q and k, as transformers sets head_dim
        head_dim = _int_field(config, "qk_rope_head_dim")
    else:
        head_dim = _int_field(config, "head_dim", default=hidden // heads)
    return ModelShape(
        num_layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        num_heads=heads,
        num_kv_heads=_int_field(config, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab=_int_field(config, "vocab_size"),
        name=name,
        **_expert_fields(config, intermediate, layers),
        **_sliding_fields(config, layers),
        **latent,
    )


def _expert_fields(config: Mapping[str, Any], intermediate: int, layers: int) -> dict[str, Any]:
    """The MoE fields as Mixtral (`num_local_experts`, experts of `intermediate_size` rows),
    Qwen3-MoE (`num_experts`, `moe_intermediate_size`, `decoder_sparse_step`,
    `mlp_only_layers`) and DeepSeek-V3 (`n_routed_experts`, `first_k_dense_replace` dense
    layers first, `n_shared_experts` of `moe_intermediate_size` rows) name them; none for a
    dense config."""
    keys = [k for k in ("num_local_experts", "n_routed_experts", "num_experts") if config.get(k)]
    if not keys:
        return {}
    dense = config.get("mlp_only_layers") or ()
    if not isinstance(dense, (list, tuple)) or not all(type(i) is int for i in dense):
        raise ValueError(f"model config field mlp_only_layers must list ints, got {dense!r}")
    if config.get("first_k_dense_replace"):
        dense = range(min(_int_field(config, "first_k_dense_replace"), layers))
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError("model config field moe_layer_freq: only 1 (every layer past the dense)")
    moe_intermediate = _int_field(config, "moe_intermediate_size", default=intermediate)
    shared = config.get("n_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"model config field n_shared_experts must be an int >= 0, got {shared!r}")
    return dict(
        num_experts=_int_field(config, keys[0]),
        experts_per_tok=_int_field(config, "num_experts_per_tok"),
        moe_intermediate=moe_intermediate,
        sparse_step=_int_field(config, "decoder_sparse_step", default=1),
        dense_layers=tuple(dense),
        shared_intermediate=shared * moe_intermediate,
    )


def _latent_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention as DeepSeek-V3's config names it (`kv_lora_rank`,
    `q_lora_rank`, `qk_nope_head_dim`, `v_head_dim`; `qk_rope_head_dim` is the shape's
    head_dim); none without `kv_lora_rank`."""
    if not config.get("kv_lora_rank"):
        return {}
    if config.get("q_lora_rank") is None:
        raise ValueError("model config: latent attention without q_lora_rank is not charged")
    return dict(
        kv_lora_rank=_int_field(config, "kv_lora_rank"),
        q_lora_rank=_int_field(config, "q_lora_rank"),
        qk_nope_head_dim=_int_field(config, "qk_nope_head_dim"),
        v_head_dim=_int_field(config, "v_head_dim"),
    )


def _sliding_fields(config: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The sliding layers as `layer_types` lists them, windows of `sliding_window`; without
    `layer_types`, gpt-oss's even layers (as transformers' GptOssConfig fills it in). Other
    configs without `layer_types` (Mistral's, Qwen2's) keep full attention, as before."""
    if config.get("sliding_window") is None:
        return {}
    types = config.get("layer_types")
    if types is None and config.get("model_type") == "gpt_oss":
        types = [SLIDING_TYPE if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types is None:
        return {}
    if not isinstance(types, (list, tuple)) or len(types) != layers:
        raise ValueError(f"model config field layer_types must list {layers} layer types")
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING_TYPE)
    if not sliding:
        return {}
    return dict(sliding_window=_int_field(config, "sliding_window"), sliding_layers=sliding)


def _int_field(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:  # NOTE: transformers writes null for some absent fields (head_dim)
        value = default
    if value is None:
        raise ValueError(f"model config lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config field {key} must be a positive int, got {value!r}")
    return value


def _moe(e: int, k: int, inter: int) -> dict[str, int]:
    return dict(num_experts=e, experts_per_tok=k, moe_intermediate=inter)


def _gpt_oss(name: str, layers: int, experts: int) -> ModelShape:
    """gpt-oss: every layer sparse (top 4), windows of 128 on the even layers."""
    return ModelShape(
        layers,
        2880,
        2880,
        64,
        8,
        64,
        201088,
        name=name,
        **_moe(experts, 4, 2880),
        sliding_window=128,
        sliding_layers=tuple(range(0, layers, 2)),
    )


# deepseek-ai/DeepSeek-V3's config.json, the fields its shape reads: 61 layers, the first 3
# dense (18,432 rows), then 256 routed experts of 2,048 rows (8 a token) and one shared;
# latent attention over 128 heads. Its checkpoint's weights are FP8; charged here in
# EMULATED_DTYPE like every preset. Its multi-token-prediction layer
# (num_nextn_predict_layers 1) is not part of the prefill's forward.
DEEPSEEK_V3_CONFIG = {
    "_name_or_path": "DeepSeek-V3",
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 129280,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
}

# The models' config.json on the Hugging Face Hub (the name is the repository's).
# Positional: layers, hidden, intermediate, heads, KV heads, head_dim, vocab.
PRESETS = {
    "Qwen2.5-0.5B": ModelShape(24, 896, 4864, 14, 2, 64, 151936, name="Qwen2.5-0.5B"),
    "Llama-3.1-8B": ModelShape(32, 4096, 14336, 32, 8, 128, 128256, name="Llama-3.1-8B"),
    "Qwen2.5-14B": ModelShape(48, 5120, 13824, 40, 8, 128, 152064, name="Qwen2.5-14B"),
    "Llama-3.1-70B": ModelShape(80, 8192, 28672, 64, 8, 128, 128256, name="Llama-3.1-70B"),
    "Qwen3-8B": ModelShape(36, 4096, 12288, 32, 8, 128, 151936, name="Qwen3-8B"),
    "Qwen3-32B": ModelShape(64, 5120, 25600, 64, 8, 128, 151936, name="Qwen3-32B"),
    "Mixtral-8x7B": ModelShape(
        32, 4096, 14336, 32, 8, 128, 32000, name="Mixtral-8x7B", **_moe(8, 2, 14336)
    ),
    "Qwen3-30B-A3B": ModelShape(
        48, 2048, 6144, 32, 4, 128, 151936, name="Qwen3-30B-A3B", **_moe(128, 8, 768)
    ),
    "Qwen3-235B-A22B": ModelShape(
        94, 4096, 12288, 64, 4, 128, 151936, name="Qwen3-235B-A22B", **_moe(128, 8, 1536)
    ),
    "gpt-oss-20b": _gpt_oss("gpt-oss-20b", 24, 32),
    "gpt-oss-120b": _gpt_oss("gpt-oss-120b", 36, 128),
    "DeepSeek-V3": ModelShape.from_hf_config(DEEPSEEK_V3_CONFIG),
}


def resolve_shape(spec: str) -> ModelShape:
    """A preset name (any case), or a path to a config.json or to a directory holding one."""
    by_lower = {name.lower(): shape for name, shape in PRESETS.items()}
    if spec.lower() in by_lower:
        return by_lower[spec.lower()]
    if Path(spec).exists():
        return ModelShape.from_hf_config(spec)
    raise ValueError(f"unknown model {spec!r}: not a path; presets are {', '.join(PRESETS)}")
