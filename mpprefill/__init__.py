"""mpprefill: the prefill side of a PD-disaggregated LLM server."""

from __future__ import annotations

__all__ = ["PrefillEngine", "PrefillOutput"]


def __getattr__(name: str):
    # Lazy, so that `mpprefill --help` and the ipc-only paths do not load the model code.
    if name in __all__:
        from mpprefill import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'mpprefill' has no attribute {name!r}")
