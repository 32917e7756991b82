"""Bench helpers: workloads, statistics, a progress bar."""

from __future__ import annotations

from mpprefill.bench.progress import Progress
from mpprefill.bench.stats import percentile
from mpprefill.bench.workload import (
    RequestSpec,
    Workload,
    WorkloadParams,
    arrival_times,
    random_prompts,
    simulate_hit_rate,
    solve_for_hit_rate,
)

__all__ = [
    "Progress",
    "RequestSpec",
    "Workload",
    "WorkloadParams",
    "arrival_times",
    "percentile",
    "random_prompts",
    "simulate_hit_rate",
    "solve_for_hit_rate",
]
