"""Model shape: one frozen dataclass, built in (tiny) or read from an HF config.json dict by
the architecture's family (`families.config_from_hf`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

# NOTE: the registry (`families/__init__.py`) holds one family for each of these; a test
# keeps the two in step.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")
MOE_SCORINGS = ("softmax", "sigmoid")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = tuple(_DTYPES)


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling other than the default, as config.json's rope_scaling (or
    rope_parameters) names it; `layers/rotary.py` turns it into frequencies. Fields a type
    does not use stay None."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn; None: derived from factor (and mscales)
    beta_fast: float | None = None  # yarn; None: 32
    beta_slow: float | None = None  # yarn; None: 1
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards

    def __post_init__(self) -> None:
        _require(
            self.rope_type in ROPE_TYPES,
            f"rope type {self.rope_type!r} is not supported; known: default, {ROPE_TYPES}",
        )
        _require(self.factor > 0, f"rope factor must be positive, got {self.factor}")
        needs = {
            "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
            "yarn": ("original_max_position_embeddings",),
        }.get(self.rope_type, ())
        missing = [k for k in needs if getattr(self, k) is None]
        _require(not missing, f"rope type {self.rope_type!r} needs {missing}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. head_dim 0 means hidden_size // num_attention_heads."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: the default rotary
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    attention_sinks: bool = False  # one learned sink logit per query head (gpt-oss)
    architecture: str = "LlamaForCausalLM"
    dtype: str = "float32"
    # Sliding-window attention: a layer of type "sliding_attention" sees the last
    # `sliding_window` positions (itself included); None everywhere means full attention.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts: 0 experts means every layer's MLP is dense. Each token goes to
    # its `num_experts_per_tok` most probable experts (softmax, then top-k; their weights
    # renormalised to sum to 1 with `norm_topk_prob`); `dense_mlp_layers` keep the dense
    # MLP of `intermediate_size` rows.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()
    # gpt-oss's experts: biases on the router and on every expert's gate/up and down, and
    # its clamped SwiGLU (None: plain SiLU): (clamp(up, -l, l) + 1) * g * sigmoid(alpha g)
    # with g = min(gate, l).
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek's routing (`moe_scoring` "sigmoid"): each expert's sigmoid score, plus a
    # learned bias that counts for the choice only; experts in `n_group` groups, a token
    # choosing among the `topk_group` groups of the largest top-2 sums; the chosen scores
    # (renormalised with `norm_topk_prob`) times `routed_scaling_factor`. Shared experts: a
    # dense MLP of `shared_expert_intermediate_size` rows every token also runs (0: none).
    moe_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    # Multi-head latent attention (DeepSeek), on when `kv_lora_rank` > 0: q through a
    # low-rank `q_lora_rank` projection (None: one q projection), K and V decompressed from
    # a per-token latent of `kv_lora_rank` plus a rope key of `qk_rope_head_dim` shared by
    # all heads, which is what the KV pool holds. Each head's q and k: `qk_nope_head_dim`
    # unrotated then `qk_rope_head_dim` rotated; its v: `v_head_dim`. `head_dim` is the
    # rotated part's (the rotary's width), as transformers sets it. `rope_interleave`: the
    # checkpoint's rope pairs are adjacent, (x0, x1), (x2, x3), .. .
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        self._check_layer_types()
        self._check_experts()
        self._check_latent_attention()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(self.max_position_embeddings > 0, "max_position_embeddings must be positive")
        self._check_heads()
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        _require(
            self.architecture in SUPPORTED_ARCHITECTURES,
            f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}",
        )
        _require(self.dtype in _DTYPES, f"dtype {self.dtype!r} is not one of {tuple(_DTYPES)}")

    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _require(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        bad = set(self.layer_types) - set(LAYER_TYPES)
        _require(not bad, f"unknown layer types {sorted(bad)}; known: {LAYER_TYPES}")
        _require(
            self.sliding_window is None or self.sliding_window > 0,
            f"sliding_window must be positive, got {self.sliding_window}",
        )

    def is_sliding(self, layer: int) -> bool:
        """True when `layer` attends only to the last `sliding_window` positions."""
        return (
            self.sliding_window is not None
            and self.layer_types is not None
            and self.layer_types[layer] == "sliding_attention"
        )

    def _check_experts(self) -> None:
        object.__setattr__(self, "dense_mlp_layers", tuple(self.dense_mlp_layers))
        _require(self.num_experts >= 0, f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts == 0:
            return
        e, k = self.num_experts, self.num_experts_per_tok
        _require(0 < k <= e, f"num_experts_per_tok ({k}) must be in 1..num_experts ({e})")
        _require(
            self.moe_intermediate_size > 0,
            f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}",
        )
        bad = [i for i in self.dense_mlp_layers if not 0 <= i < self.num_hidden_layers]
        _require(not bad, f"dense_mlp_layers {bad} are not layers of {self.num_hidden_layers}")
        self._check_routing()

    def _check_routing(self) -> None:
        _require(
            self.moe_scoring in MOE_SCORINGS,
            f"moe_scoring {self.moe_scoring!r} is not one of {MOE_SCORINGS}",
        )
        e, groups, top = self.num_experts, self.n_group, self.topk_group
        _require(
            groups > 0 and e % groups == 0,
            f"n_group ({groups}) must divide num_experts ({e})",
        )
        _require(0 < top <= groups, f"topk_group ({top}) must be in 1..n_group ({groups})")
        _require(
            groups == 1 or e // groups >= 2,
            f"grouped routing sums each group's top 2: {e} experts in {groups} groups",
        )
        _require(
            top * e // groups >= self.num_experts_per_tok,
            f"topk_group ({top}) groups hold fewer than num_experts_per_tok experts",
        )
        _require(self.shared_expert_intermediate_size >= 0, "shared experts' size must be >= 0")

    def _check_latent_attention(self) -> None:
        if self.kv_lora_rank == 0:
            return
        _require(self.kv_lora_rank > 0, f"kv_lora_rank must be >= 0, got {self.kv_lora_rank}")
        q_rank = self.q_lora_rank
        _require(q_rank is None or q_rank > 0, f"q_lora_rank must be positive, got {q_rank}")
        _require(self.qk_nope_head_dim >= 0, "qk_nope_head_dim must be >= 0")
        _require(self.v_head_dim > 0, f"v_head_dim must be positive, got {self.v_head_dim}")
        _require(
            self.head_dim == self.qk_rope_head_dim,
            f"latent attention rotates head_dim ({self.head_dim}) ="
            f" qk_rope_head_dim ({self.qk_rope_head_dim})",
        )
        _require(
            self.num_key_value_heads == self.num_attention_heads,
            "latent attention decompresses K and V for every head: num_key_value_heads"
            f" ({self.num_key_value_heads}) must equal num_attention_heads",
        )
        _require(not self.has_sliding_layers, "latent attention has no sliding-window layers")
        _require(not self.attention_sinks, "latent attention has no attention sinks")

    @property
    def is_latent(self) -> bool:
        """Multi-head latent attention (see `kv_lora_rank`)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Each head's q and k width under latent attention: unrotated then rotated."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of the one row a token keeps per layer in a latent KV pool (the latent and
        the rope key); 0: the pool holds K and V per KV head."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_latent else 0

    def is_moe(self, layer: int) -> bool:
        """True when `layer`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.is_sliding(i) for i in range(self.num_hidden_layers))

    def _check_heads(self) -> None:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        _require(heads > 0 and kv_heads > 0, f"head counts must be positive: {heads}, {kv_heads}")
        _require(
            heads % kv_heads == 0,
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})",
        )
        _require(self.head_dim >= 0, f"head_dim must be >= 0, got {self.head_dim}")
        _require(
            self.head_dim > 0 or self.hidden_size % heads == 0,
            f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads ({heads})",
        )
        _require(self.head_size % 2 == 0, f"head dim must be even for rotary, got {self.head_size}")

    @property
    def head_size(self) -> int:
        """The per-head dimension actually used (head_dim, or hidden // heads when 0)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The built-in default model: a 2048-token CPU forward well under a second."""
        return cls()


class Dtypes(NamedTuple):
    """What a server runs in: the model's weights and activations, and its KV pool."""

    model: str
    kv: str

    @property
    def kv_torch(self) -> torch.dtype:
        return _DTYPES[self.kv]

    @property
    def itemsizes(self) -> tuple[int, int]:
        """Bytes per element of the model's tensors and of the KV pool's."""
        return _DTYPES[self.model].itemsize, _DTYPES[self.kv].itemsize


def resolve_dtypes(dtype: str, kv_cache_dtype: str, checkpoint: str) -> Dtypes:
    """--dtype and --kv-cache-dtype against the `checkpoint`'s dtype (its config.json's
    torch_dtype; float32 for the built-in model): `auto` is the checkpoint's, a KV `auto`
    the model's.

    NOTE: a dtype resolved already resolves the same again, so a process holding the served
    config (the forward process's Ready, a TP shard's) may pass its dtype for the checkpoint's.
    """
    for flag, value in (("dtype", dtype), ("kv-cache-dtype", kv_cache_dtype)):
        _require(value == "auto" or value in _DTYPES, f"--{flag} {value!r}: auto or {DTYPES}")
    model = checkpoint if dtype == "auto" else dtype
    return Dtypes(model, model if kv_cache_dtype == "auto" else kv_cache_dtype)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
