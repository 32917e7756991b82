"""Small statistics for bench results: percentiles."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], p: float) -> float:
    """p-th percentile (0..100) with linear interpolation between ranks; nan when empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = list(values)
    return float(np.percentile(xs, p)) if xs else math.nan
