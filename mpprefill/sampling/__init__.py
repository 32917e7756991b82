"""Sampling: per-request parameters, their batched tensors, and the sampler."""

from __future__ import annotations

from mpprefill.sampling.info import PACKED_FIELDS, SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.sampler import sample

__all__ = ["PACKED_FIELDS", "SamplingBatchInfo", "SamplingParams", "sample"]
