"""Small statistics for bench results: percentiles, a timer."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


def percentile(values: Iterable[float], p: float) -> float:
    """p-th percentile (0..100) with linear interpolation between ranks; nan when empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50)


def mean(values: Iterable[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs) if xs else math.nan


def describe(values: Iterable[float]) -> dict[str, float]:
    """p50 / p99 / mean / max, the shape bench JSON uses for latencies."""
    xs = list(values)
    return {
        "p50": percentile(xs, 50),
        "p99": percentile(xs, 99),
        "mean": mean(xs),
        "max": max(xs) if xs else math.nan,
    }


@dataclass
class Timer:
    """`with Timer() as t: ...` then `t.elapsed_s`; also usable with start()/stop()."""

    start_s: float = field(default=0.0, init=False)
    elapsed_s: float = field(default=0.0, init=False)
    running: bool = field(default=False, init=False)

    def start(self) -> Timer:
        self.start_s, self.running = time.perf_counter(), True
        return self

    def stop(self) -> float:
        if self.running:
            self.elapsed_s += time.perf_counter() - self.start_s
            self.running = False
        return self.elapsed_s

    @property
    def now_s(self) -> float:
        """Elapsed so far, including a running lap."""
        lap = time.perf_counter() - self.start_s if self.running else 0.0
        return self.elapsed_s + lap

    def __enter__(self) -> Timer:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
