"""`--sliding-window` / `--swa-layers`: make layers of any model sliding-window layers."""

from __future__ import annotations

import dataclasses

from mpprefill.layer_configs import SWA_PATTERN_HELP
from mpprefill.model.config import ModelConfig


def parse_swa_layers(pattern: str, num_layers: int) -> tuple[str, ...]:
    """Layer types ("sliding_attention" / "full_attention") a pattern names."""
    p = pattern.strip().lower()
    if p == "all":
        sliding = set(range(num_layers))
    elif p and set(p) <= {"s", "f"}:
        sliding = {i for i in range(num_layers) if p[i % len(p)] == "s"}
    else:
        try:
            sliding = {int(x) for x in p.split(",") if x.strip()}
        except ValueError:
            raise ValueError(f"--swa-layers {pattern!r}: {SWA_PATTERN_HELP}") from None
        if not sliding:
            raise ValueError(f"--swa-layers {pattern!r} names no layer")
        bad = sorted(i for i in sliding if not 0 <= i < num_layers)
        if bad:
            raise ValueError(f"--swa-layers names layers {bad}; the model has {num_layers}")
    return tuple(
        "sliding_attention" if i in sliding else "full_attention" for i in range(num_layers)
    )


def with_sliding_window(
    config: ModelConfig, window: int | None = None, pattern: str | None = None
) -> ModelConfig:
    """The config with its window and/or sliding layers replaced. A window without a pattern
    keeps the model's sliding layers, or makes all layers slide when it has none."""
    if window is None and pattern is None:
        return config
    window = window if window is not None else config.sliding_window
    if window is None:
        raise ValueError("--swa-layers needs --sliding-window: the model declares no window")
    if window < 1:
        raise ValueError(f"--sliding-window must be positive, got {window}")
    if pattern is not None:
        types = parse_swa_layers(pattern, config.num_hidden_layers)
    elif config.layer_types is not None and config.has_sliding_layers:
        types = config.layer_types
    else:
        types = parse_swa_layers("all", config.num_hidden_layers)
    return dataclasses.replace(config, sliding_window=window, layer_types=types)
