"""TTFT at the decode, through a real decode server, with and without a slow emulated link.

The slow link's figures are arithmetic, not a race: the four requests arrive at once and
their transfers cross one serialized link, so the k-th completion the decode sees comes at
least k transfers' link time after the sends, whatever the machine's speed; the link's
time (about 0.21 s a request) dwarfs the rest of a request's TTFT here (some 10-40 ms).
"""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import random_prompts
from mpprefill.config import ServerArgs
from mpprefill.model import ModelConfig

pytestmark = pytest.mark.timeout(240)

PROMPT = 128  # tokens: 8 pages of 16
GBPS = 0.01


def kv_bytes_per_token(config: ModelConfig) -> int:
    """K and V of every layer, float32."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_size * 4


def test_ttft_at_the_decode_grows_by_the_link_time_of_the_transfers_before_it(tmp_path):
    args = ServerArgs(
        disaggregation_transfer_backend="shm", max_total_tokens=2048, worker_threads=1
    )
    work = random_prompts(4, PROMPT, seed=3)
    runs = {}
    for name, server in (
        ("direct", args),
        ("slow link", dataclasses.replace(args, emulate_link_gbps=GBPS)),
    ):
        cfg = BenchConfig(server, ["normal"], warmup_requests=1, log_dir=str(tmp_path))
        runs[name] = run = run_mode(cfg, "normal", work)
        assert run["num_failed"] == 0 and run["leaks"]["ok"], run
        assert 0 < run["ttft_decode_p50_ms"] <= run["ttft_decode_p99_ms"]
        # the decode sends the first token before the bench receives it
        assert run["ttft_decode_p50_ms"] <= run["ttft_ms"]["p50"]
    link_ms = PROMPT * kv_bytes_per_token(ModelConfig.tiny()) * 8 / (GBPS * 1e9) * 1e3
    direct, slow = runs["direct"], runs["slow link"]
    # of 4 completions the 2nd and 3rd waited for >= 2 and 3 transfers: p50 >= 2.5, p99 >= 3
    assert slow["ttft_decode_p50_ms"] >= 2.5 * link_ms
    assert slow["ttft_decode_p99_ms"] >= 3 * link_ms
    assert slow["ttft_decode_p50_ms"] - direct["ttft_decode_p50_ms"] >= link_ms
    assert slow["first_tokens_sha256"] == direct["first_tokens_sha256"]
