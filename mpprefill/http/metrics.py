"""`GET /metrics`: Prometheus text through prometheus-client, SGLang's names where a meaning
matches.

Two sources:

- what the front measures of each request it answers (its own registry): the counters of
  prompt, cached and generated tokens and of requests, and the latency histograms (time
  to first token, end to end), from the moment the body was read;
- the server's `stats` reply, asked for at each scrape (`SchedulerCollector`). A prefill
  server's: queue lengths, KV pool usage, the prefix cache's hit rate, KV transfers, and
  mpprefill's own overlap figures under `mpprefill:`. A decode server's (its stats say
  `disaggregation_mode: decode`): its batch and queues (SGLang's decode names: the
  prealloc queue waits for pages, the transfer queue for KV) and its KV pool's usage.

The overlap gauges (forward busy fraction, t_sched) cover the time since the previous
scrape (since the server started, at the first one); the hand-off gap is the median of
the scheduler's recent gaps.
"""

from __future__ import annotations

import statistics
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# SGLang's buckets (seconds), cut to the range a prefill server reaches.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
TTFT_BUCKETS += (2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 60.0, 120.0, 300.0, 600.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0)
E2E_BUCKETS += (80.0, 100.0, 200.0, 400.0, 600.0, 1200.0)


class FrontMetrics:
    """The front's registry: its request counters and histograms, and the scheduler's
    figures as of the latest stats reply."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            hist = Histogram(name, doc, names, buckets=buckets, registry=self.registry)
            return hist.labels(**self.labels)

        self.prompt_tokens = counter(
            "sglang:prompt_tokens_total", "Prompt tokens of requests done."
        )
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Output tokens of requests done."
        )
        self.cached_tokens = counter(
            "sglang:cached_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self.requests = counter("sglang:num_requests_total", "Requests done.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Requests aborted.")
        self.failed = counter("mpprefill:num_failed_requests_total", "Requests that failed.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            E2E_BUCKETS,
        )
        self.scheduler = SchedulerCollector(self.labels)
        self.registry.register(self.scheduler)

    def on_done(self, meta: dict[str, Any], seconds: float, saw_first_token: bool) -> None:
        """A prompt answered with a body: `meta` is its meta_info."""
        if meta["finish_reason"] and meta["finish_reason"].get("type") == "abort":
            self.aborted.inc()
            return
        self.requests.inc()
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.cached_tokens.inc(meta["cached_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self.e2e.observe(seconds)
        if not saw_first_token and meta["completion_tokens"] > 0:
            self.ttft.observe(seconds)


class SchedulerCollector:
    """The scheduler's figures from its latest stats reply (none before the first)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self.stats: dict[str, Any] | None = None
        self._prev: dict[str, Any] | None = None  # the stats of the previous scrape
        self._window: dict[str, float] = {}

    def update(self, stats: dict[str, Any]) -> None:
        """A fresh stats reply; the windowed gauges cover the time since the last one."""
        self._prev, self.stats = self.stats, stats
        self._window = {} if _is_decode(stats) else _window(self._prev, stats)

    def collect(self):
        if self.stats is None:
            return
        if _is_decode(self.stats):
            for name, doc, value in _decode_gauges(self.stats):
                yield self._family(GaugeMetricFamily, name, doc, value)
            return
        for name, doc, value in self._gauges():
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in self._counters():
            yield self._family(CounterMetricFamily, name, doc, value)

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _gauges(self) -> list[tuple[str, str, float]]:
        s = self.stats
        q, kv, c = s["queues"], s["kv"], s["counters"]
        total = kv["total_tokens"]
        used = total - kv["free_tokens"] - kv.get("evictable_tokens", kv["cached_tokens"])
        gaps = c.get("handoff_gaps_ms") or [0.0]
        return [
            ("sglang:num_running_reqs", "Requests being prefilled.", q.get("running", 0)),
            ("sglang:num_queue_reqs", "Requests waiting for admission.", q["waiting"]),
            (
                "sglang:num_prefill_prealloc_queue_reqs",
                "Requests waiting for their decode side (the bootstrap queue).",
                q["bootstrap"],
            ),
            (
                "sglang:num_prefill_inflight_queue_reqs",
                "Prefilled requests whose KV is on its way.",
                q["inflight"],
            ),
            ("sglang:num_used_tokens", "KV tokens held by requests.", used),
            ("sglang:token_usage", "KV pool usage by requests.", used / total if total else 0.0),
            ("sglang:max_total_num_tokens", "KV pool capacity in tokens.", total),
            (
                "sglang:cache_hit_rate",
                "Prompt tokens served from the prefix cache, over every request done.",
                c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
            ),
            (
                "sglang:kv_transfer_latency_ms",
                "KV transfer latency, mean over recent requests (last chunk to decode's ack).",
                c.get("kv_transfer_latency_ms", 0.0),
            ),
            (
                "mpprefill:forward_busy_fraction",
                "Device busy time over wall time since the previous scrape.",
                self._window.get("busy", 0.0),
            ),
            (
                "mpprefill:t_sched_ms",
                "The scheduler's own work per batch since the previous scrape (ms).",
                self._window.get("t_sched_ms", 0.0),
            ),
            (
                "mpprefill:handoff_gap_ms",
                "Median device idle time between back-to-back forwards, recent batches (ms).",
                statistics.median(gaps),
            ),
        ]

    def _counters(self) -> list[tuple[str, str, float]]:
        c = self.stats["counters"]
        return [
            (
                "sglang:num_transfer_failed_reqs_total",
                "Requests whose KV transfer failed.",
                c.get("num_transfer_failed", 0),
            ),
            (
                "sglang:num_bootstrap_failed_reqs_total",
                "Requests that failed while waiting for their decode side (bootstrap).",
                c.get("num_bootstrap_failed", 0),
            ),
            ("mpprefill:batches_total", "Forward batches run.", c["num_batches"]),
            ("mpprefill:batch_tokens_total", "Tokens forwarded.", c["batch_tokens"]),
            ("mpprefill:forward_seconds_total", "Host time of the forwards.", c["forward_s"]),
            ("mpprefill:device_seconds_total", "Device busy time of the forwards.", c["device_s"]),
            (
                "mpprefill:collective_seconds_total",
                "Device time of the forwards in collectives (emulated tensor parallel).",
                c["collective_s"],
            ),
            ("mpprefill:sched_seconds_total", "The scheduler's own work.", c.get("sched_s", 0.0)),
            (
                "mpprefill:finished_reqs_total",
                "Requests the scheduler finished.",
                c["num_finished"],
            ),
            ("mpprefill:failed_reqs_total", "Requests the scheduler failed.", c["num_failed"]),
        ]


def _is_decode(stats: dict[str, Any]) -> bool:
    return stats.get("disaggregation_mode") == "decode"


def _decode_gauges(s: dict[str, Any]) -> list[tuple[str, str, float]]:
    """A decode server's figures, from its stats (decode/server.py)."""
    total = s["max_total_num_tokens"]
    used = s["load"]["num_tokens"]
    return [
        ("sglang:num_running_reqs", "Requests in the decode batch.", s["running"]),
        ("sglang:num_queue_reqs", "Requests with their KV, waiting for the batch.", s["waiting"]),
        (
            "sglang:num_decode_prealloc_queue_reqs",
            "Requests waiting for KV pages.",
            s["pending"],
        ),
        (
            "sglang:num_decode_transfer_queue_reqs",
            "Requests whose KV is on its way from the prefill.",
            s["rooms"],
        ),
        ("sglang:num_used_tokens", "KV tokens held by requests.", used),
        ("sglang:token_usage", "KV pool usage by requests.", used / total if total else 0.0),
        ("sglang:max_total_num_tokens", "KV pool capacity in tokens.", total),
    ]


def _window(prev: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, float]:
    """Busy fraction and t_sched over the time between two stats replies (from the start,
    for the first)."""
    c1 = now["counters"]
    c0 = prev["counters"] if prev else {"device_s": 0.0, "sched_s": 0.0, "num_batches": 0}
    wall = now.get("uptime_s", 0.0) - (prev.get("uptime_s", 0.0) if prev else 0.0)
    batches = c1["num_batches"] - c0["num_batches"]
    sched = c1.get("sched_s", 0.0) - c0.get("sched_s", 0.0)
    return {
        "busy": (c1["device_s"] - c0["device_s"]) / wall if wall > 0 else 0.0,
        "t_sched_ms": sched / batches * 1e3 if batches else 0.0,
    }
