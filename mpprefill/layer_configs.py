"""The small frozen configs each layer takes, built from `ServerArgs` at the edge: the
model loader, the KV pools, the host tier and the worker never see the whole server's
settings."""

from __future__ import annotations

SWA_PATTERN_HELP = (
    "which layers slide: 'all', layer ids '0,2,5', or a pattern of s (sliding) and f (full)"
    " repeated over the layers, e.g. 'sssf'"
)
