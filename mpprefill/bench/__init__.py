"""Bench helpers: workloads, statistics, a progress bar."""
