"""Bench helpers: workloads, statistics, a progress bar."""

from __future__ import annotations

from mpprefill.bench.progress import Progress
from mpprefill.bench.stats import Timer, describe, median, percentile
from mpprefill.bench.workload import (
    RequestSpec,
    Workload,
    WorkloadParams,
    arrival_times,
    generated_shared_prefix,
    random_prompts,
    simulate_hit_rate,
    solve_for_hit_rate,
)

__all__ = [
    "Progress",
    "RequestSpec",
    "Timer",
    "Workload",
    "WorkloadParams",
    "arrival_times",
    "describe",
    "generated_shared_prefix",
    "median",
    "percentile",
    "random_prompts",
    "simulate_hit_rate",
    "solve_for_hit_rate",
]
