"""Reading a Hugging Face config.json: the fields every dense family shares, and refusals.

A family module (`families/`) reads its own fields and passes the rest through
`dense_fields`. A field that would change the model's arithmetic and that the family does
not implement is refused here with its name, never ignored.
"""

from __future__ import annotations

from typing import Any

from mpprefill.model.config import DTYPES, RopeScaling

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "rms_norm_eps",
    "max_position_embeddings",
)
# Keys a rope dict may hold, by type, besides rope_type / type / rope_theta.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def refuse(hf: dict[str, Any], field: str, allowed: tuple = (None,), why: str = "") -> None:
    """Raise, naming `field`, unless config.json's value of it is one of `allowed` (absent
    counts as None)."""
    value = hf.get(field)
    if value not in allowed:
        raise ValueError(f"config.json's {field}={value!r} is not supported{why}")


def dense_fields(hf: dict[str, Any], head_dim: int | None = None) -> dict[str, Any]:
    """ModelConfig fields every dense family reads alike. `head_dim`: the family's default
    when config.json names none (None: hidden_size / num_attention_heads)."""
    missing = [k for k in REQUIRED_KEYS if hf.get(k) is None]
    require(not missing, f"config.json lacks required keys: {missing}")
    refuse(hf, "hidden_act", ("silu", None), " (only silu)")
    refuse(hf, "mlp_bias", (False, None))
    refuse(hf, "quantization_config", (None,), " (only unquantized weights)")
    theta, scaling = rope(hf)
    return {
        **{k: hf[k] for k in REQUIRED_KEYS},
        "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": int(hf.get("head_dim") or head_dim or 0),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "dtype": checkpoint_dtype(hf),
    }


def rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) as transformers reads them: `rope_scaling` over `rope_parameters`,
    theta from the rope dict over the top level, `original_max_position_embeddings` from the
    top level over the rope dict over `max_position_embeddings`."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    kind = params.pop("rope_type", params.pop("type", "default"))
    require(
        kind in _ROPE_KEYS,
        f"config.json's {key} of type {kind!r} is not supported; known: {tuple(_ROPE_KEYS)}",
    )
    theta = float(params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    for source in (params, hf):
        refuse(source, "partial_rotary_factor", (None, 1, 1.0), " (the whole head rotates)")
    params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - set(_ROPE_KEYS[kind]))
    require(not unknown, f"config.json's {key} of type {kind!r}: unsupported fields {unknown}")
    if kind == "default":
        return theta, None
    require("factor" in params, f"config.json's {key} of type {kind!r} needs factor")
    if kind in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = (
            hf.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings")
        )
    return theta, RopeScaling(rope_type=kind, **params)


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """config.json's dtype: `torch_dtype`, or `dtype` as transformers 5 writes it; float32
    where it names none, as transformers loads such a checkpoint."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    name = str(name).removeprefix("torch.")
    require(name in DTYPES, f"config.json's torch_dtype {name!r} is not one of {DTYPES}")
    return name


def layer_sliding(hf: dict[str, Any], window: int | None, first: int) -> dict[str, Any]:
    """Window and layer types of the Qwen families: config.json's layer_types, else layers
    from `first` (max_window_layers) on slide; none without a window."""
    types = hf.get("layer_types")
    if types is None and window is not None:
        types = [
            "sliding_attention" if i >= first else "full_attention"
            for i in range(hf["num_hidden_layers"])
        ]
    if types is None or window is None:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}
