"""One bench run per forward mode: fresh processes, warm-up, run, drain, checks, shutdown."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import zmq
from tqdm import tqdm

from mpprefill.bench.http_bridge import HttpBridge
from mpprefill.bench.procs import Child, start_decode, start_server
from mpprefill.bench.router import ReqResult, Router
from mpprefill.bench.workload import Workload, random_prompts
from mpprefill.config import ServerArgs
from mpprefill.scheduling.metrics import SCHED_PHASES
from mpprefill.server.client import Client

_DECODE_VALUES = (
    "page_size",
    "max_total_tokens",
    "random_seed",
    "disaggregation_transfer_backend",
    "model_path",
    "sliding_window",
    "swa_layers",
    "dtype",
    "kv_cache_dtype",
)
_SERVE_VALUES = (
    *_DECODE_VALUES,
    "chunked_prefill_size",
    "max_running_requests",
    "max_prefill_tokens",
    "worker_threads",
    "device",
    "staging",
    "swa_full_tokens_ratio",
    "context_length",
    "tp_size",
    "switch_interval_ms",
    "attention_backend",
)
_EMULATED_VALUES = ("emulate_model", "emulate_gpu", "emulate_launch_us", "emulate_issue")
_LINK_VALUES = ("emulate_link_gbps", "emulate_link_latency_us")
_SERVE_SWITCHES = (
    "disaggregation_layerwise_send",
    "delay_sampling",
    "disable_batched_writeback",
    "swa_free_out_of_window",
    "disable_radix_cache",
)


@dataclass
class BenchConfig:
    server: ServerArgs
    modes: list[str]
    warmup_requests: int = 8
    timeout_s: float = 600.0
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mpp-bench-"))
    trace_dir: str | None = None
    verify: bool = False
    max_concurrency: int | None = None  # requests unanswered at once (None: no limit)

    def server_flags(self, mode: str, record: str | None) -> list[str]:
        a = self.server
        flags = ["--forward-mode", mode, "--check-invariants", "--log-level", "warning"]
        flags += _values(a, *_SERVE_VALUES)
        flags += _switches(a, *_SERVE_SWITCHES)
        if a.worker_device.emulated:
            flags += _values(a, *_EMULATED_VALUES)
        if a.emulate_link_gbps is not None:
            flags += _values(a, *_LINK_VALUES)
        if a.host_store_size:
            flags += ["--host-store-size", a.host_store_size]
        if record:
            flags += ["--record-batches", record]
        if self.trace_dir:
            flags += ["--trace-dir", os.path.join(self.trace_dir, mode)]
        return [str(f) for f in flags]

    def decode_flags(self) -> list[str]:
        a = self.server
        flags = ["--log-level", "warning", *_values(a, *_DECODE_VALUES)]
        if a.worker_device.emulated:
            flags += ["--emulate-model", a.emulate_model]
        if self.verify:
            flags.append("--verify")
        return [str(f) for f in flags]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _values(args, *names: str) -> list:
    """`--flag value` for each of these fields that is set."""
    flags = []
    for name in names:
        if getattr(args, name) is not None:
            flags += [_flag(name), getattr(args, name)]
    return flags


def _switches(args, *names: str) -> list[str]:
    return [_flag(n) for n in names if getattr(args, n)]


def run_mode(
    cfg: BenchConfig, mode: str, work: Workload, record: str | None = None, front: str = "zmq"
) -> dict:
    """Fresh decode + server for `mode`; returns the CONTRACT run record. `front`: the
    requests go to serve's ZeroMQ socket, or through its HTTP front ("http")."""
    decode = None
    flags = cfg.server_flags(mode, record)
    if cfg.server.disaggregation_transfer_backend != "fake":
        decode = start_decode(cfg.decode_flags(), cfg.log_dir)
        flags += ["--decode-address", f"127.0.0.1:{decode.port}"]
    children = [decode] if decode else []
    try:
        server = start_server(flags, cfg.log_dir, http=front == "http")
        children.insert(0, server)
        run = _measure(cfg, mode, work, server, decode)
        run["device"] = cfg.server.worker_device.label
        run["front"] = front
    finally:
        leaks = _shutdown(children)
    leaks["invariants_ok"] = bool(run["invariants"].get("ok", False))
    leaks["ok"] = leaks["ok"] and leaks["invariants_ok"]
    run["leaks"] = leaks
    return run


def _measure(cfg: BenchConfig, mode: str, work: Workload, server: Child, decode: Child | None):
    bridge = None
    if server.http_port is not None:
        bridge = HttpBridge(zmq.Context.instance(), server.http_port, cfg.timeout_s)
    decode_port = decode.port if decode else None
    router = Router(server.port, decode_port, bridge.endpoint if bridge else None)
    client = Client(f"127.0.0.1:{server.port}")
    try:
        warm = random_prompts(
            cfg.warmup_requests, 64, seed=work.params.seed + 7919, page_size=work.params.page_size
        )
        router.run(warm.requests, room_base=1 << 40, timeout=cfg.timeout_s)
        before = client.stats()
        with progress_bar(len(work), mode) as bar:
            results = router.run(
                work.requests,
                room_base=1 << 20,
                timeout=cfg.timeout_s,
                on_complete=lambda r: bar.update(1),
                max_concurrency=cfg.max_concurrency,
            )
        after = client.stats()
    finally:
        router.close()
        client.close()
        if bridge is not None:
            bridge.close()
    return summarize_run(mode, results, before, after)


def progress_bar(total: int, mode: str) -> tqdm:
    """Requests done, on stderr: redrawn on a terminal, a line every 30 s in a log."""
    tty = sys.stderr.isatty()
    return tqdm(
        total=total, desc=f"{mode:>12}", unit="req", file=sys.stderr, mininterval=0.2 if tty else 30
    )


def summarize_run(mode: str, results: list[ReqResult], before: dict, after: dict) -> dict:
    """A run's result object: the requests' figures as the client saw them, and the
    server's counters over the run (`before` and `after` are its stats)."""
    done = [r for r in results if r.status == "done"]
    failed = [r for r in results if r.status != "done"]
    t_start = min(r.t_send for r in results)
    t_end = max((r.t_decode or r.t_prefill or t_start) for r in results)
    duration = max(t_end - t_start, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    ttft = [r.ttft_s * 1e3 for r in done]
    at_decode = [r.ttft_decode_s * 1e3 for r in done if r.ttft_decode_s is not None]
    return {
        "mode": mode,
        "uncached_itps": (prompt - cached) / duration,
        "total_itps": prompt / duration,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "num_requests": len(results),
        "num_finished": len(done),
        "num_failed": len(failed),
        "num_unverified": sum(1 for r in done if r.verified is False),
        "duration_s": duration,
        "ttft_ms": {
            "p50": float(np.percentile(ttft, 50)) if ttft else 0.0,
            "p99": float(np.percentile(ttft, 99)) if ttft else 0.0,
        },
        # None where no decode server answered (the fake backend)
        "ttft_decode_p50_ms": float(np.percentile(at_decode, 50)) if at_decode else None,
        "ttft_decode_p99_ms": float(np.percentile(at_decode, 99)) if at_decode else None,
        "first_tokens_sha256": first_tokens_sha256(done),
        **_counter_figures(before, after, duration),
        "uncached_tokens": prompt - cached,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "invariants": after.get("invariants", {}),
        "kv_at_end": after.get("kv", {}),  # pools after the drain (SWA pool too)
        "warmup_batches": before["counters"]["num_batches"],
        "errors": sorted({r.error for r in failed if r.error})[:5],
    }


def _counter_figures(before: dict, after: dict, duration: float) -> dict:
    """The scheduler's counters over the run: per-batch times, busy fractions, gaps."""
    c0, c1 = before["counters"], after["counters"]
    batches = c1["num_batches"] - c0["num_batches"]
    per_batch = 1e3 / max(batches, 1)  # seconds over the run -> ms per batch
    fwd_s = c1["forward_s"] - c0["forward_s"]
    device_s = c1["device_s"] - c0["device_s"]
    collective_s = c1["collective_s"] - c0["collective_s"]
    new_gaps = c1["handoff_n"] - c0["handoff_n"]
    gaps = c1["handoff_gaps_ms"][-new_gaps:] if new_gaps > 0 else []
    phase_s = {
        p: c1["phase_s"].get(p, 0.0) - c0["phase_s"].get(p, 0.0)
        for p in (*SCHED_PHASES, "host-retire")
    }
    return {
        "worker_busy_frac": fwd_s / duration,
        "num_batches": batches,
        "mailbox_bytes_per_batch": c1["mailbox_bytes_per_batch"],
        "t_sched_ms": sum(phase_s[p] for p in SCHED_PHASES) * per_batch,
        "t_fwd_ms": fwd_s * per_batch,
        "t_issue_ms": fwd_s * per_batch,
        "t_device_ms": device_s * per_batch,
        "device_busy_frac": device_s / duration,
        "t_collective_ms": collective_s * per_batch,
        "collective_share": collective_s / device_s if device_s > 0 else 0.0,
        "handoff_gap_ms": float(np.percentile(gaps, 50)) if gaps else 0.0,
        "handoff_batches": len(gaps),
        "phase_ms_per_batch": {p: s * per_batch for p, s in phase_s.items()},
    }


def first_tokens_sha256(done: list[ReqResult]) -> str:
    h = hashlib.sha256()
    for rid, tok in sorted((r.rid, r.first_token) for r in done):
        h.update(f"{rid}:{tok}\n".encode())
    return h.hexdigest()


def _shutdown(children: list[Child]) -> dict:
    codes = {c.name: c.stop() for c in children}
    left = [s for c in children for s in c.shm_left()]
    return {
        "ok": not left and all(v == 0 for v in codes.values()),
        "shm_segments": len(left),
        "exit_codes": codes,
    }
