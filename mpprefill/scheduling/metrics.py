"""Scheduler-side counters: phase times, forward times, hand-off gaps, finished-request
totals.

The hand-off gap of forward N + 1 is how long the device sat idle between forward N's
end and forward N + 1's start although batch N + 1 was already built when N ended: the
time the hand-off itself costs, not a wait for work.

A request's KV transfer latency runs from the result of its last chunk (its KV complete,
its sends under way) to its transfer's success; a transfer that fails after it started
counts as failed, unless its client aborted the request.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from mpprefill.trace.tracer import clock_ns, get_tracer

TRACE_NAMES = {"collect": "collect-wait"}
MAX_GAPS = 4096  # recent hand-off gaps kept for medians (they travel in stats replies)
RECENT_TRANSFERS = 256  # transfers the KV transfer latency is averaged over
# The scheduler's own work per batch (t_sched); the other phases wait for the worker.
SCHED_PHASES = ("build", "process", "sample", "snapshot", "submit", "early-send", "inflight")


@dataclass
class SchedulerMetrics:
    phase_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    phase_n: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    num_batches: int = 0
    forward_s: float = 0.0  # host time of the forward calls (issue)
    device_s: float = 0.0  # the device's busy time in the forwards
    collective_s: float = 0.0  # the part of device_s in collectives (emulated tensor parallel)
    handoff_n: int = 0
    handoff_gaps_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_GAPS))
    batch_tokens: int = 0
    mailbox_bytes: list[int] = field(default_factory=list)
    num_finished: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_loaded_tokens: int = 0  # prefix tokens loaded back from the host KV store
    host_written_tokens: int = 0  # tokens whose write-back to the host store was retired
    batch_shapes: list[tuple[list[int], list[int]]] | None = None  # (prefix, extend) lens
    num_transfers: int = 0  # KV transfers that succeeded
    num_transfer_failed: int = 0
    num_bootstrap_failed: int = 0  # failed while waiting for their decode side
    transfer_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_TRANSFERS))
    _transfer_t0: dict[str, float] = field(default_factory=dict)  # rid -> its last chunk done
    _aborted: set[str] = field(default_factory=set)  # rids their client aborted, until finished
    _built_ns: dict[int, int] = field(default_factory=dict)  # seq -> when A built it
    _last_end: tuple[int, int] = (0, 0)  # (seq, end_ns) of the last forward collected

    def add_phase(self, name: str, start_ns: int, seq: int = -1) -> None:
        """Close a phase that began at `start_ns` (trace clock); traced when tracing is on."""
        dur = clock_ns() - start_ns
        self.phase_s[name] += dur / 1e9
        self.phase_n[name] += 1
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record(TRACE_NAMES.get(name, name), start_ns, dur, seq)

    def on_built(self, seq: int) -> None:
        self._built_ns[seq] = clock_ns()

    def on_forward(self, fb, result) -> None:
        """Forward `result.seq` (its batch `fb`) was collected."""
        if self.batch_shapes is not None:
            self.batch_shapes.append((fb.prefix_lens.tolist(), fb.extend_lens.tolist()))
        self.num_batches += 1
        self.forward_s += result.forward_s
        self.device_s += result.device_s
        self.collective_s += result.collective_s
        self.batch_tokens += fb.num_tokens
        built = self._built_ns.pop(result.seq, None)
        prev_seq, prev_end = self._last_end
        if prev_seq == result.seq - 1 and built is not None and built <= prev_end:
            self.handoff_n += 1
            self.handoff_gaps_s.append(max(0, result.start_ns - prev_end) / 1e9)
        self._last_end = (result.seq, result.end_ns)

    def on_transfer_start(self, req) -> None:
        self._transfer_t0[req.rid] = time.monotonic()

    def note_abort(self, rid: str) -> None:
        self._aborted.add(rid)

    def on_finish(self, req) -> None:
        t0 = self._transfer_t0.pop(req.rid, None)
        aborted = req.rid in self._aborted
        self._aborted.discard(req.rid)
        if req.error:
            self.num_failed += 1
            self.num_transfer_failed += t0 is not None and not aborted
            return
        if t0 is not None:
            self.num_transfers += 1
            self.transfer_ms.append((time.monotonic() - t0) * 1e3)
        self.num_finished += 1
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens

    def to_dict(self) -> dict:
        mb = self.mailbox_bytes
        return {
            "mailbox_bytes_per_batch": {"mean": _mean(mb), "max": max(mb, default=0)},
            "num_batches": self.num_batches,
            "forward_s": self.forward_s,
            "device_s": self.device_s,
            "collective_s": self.collective_s,
            "handoff_n": self.handoff_n,
            "handoff_gaps_ms": [g * 1e3 for g in self.handoff_gaps_s],
            "batch_tokens": self.batch_tokens,
            "num_finished": self.num_finished,
            "num_failed": self.num_failed,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "host_loaded_tokens": self.host_loaded_tokens,
            "host_written_tokens": self.host_written_tokens,
            "phase_s": dict(self.phase_s),
            "sched_s": sum(self.phase_s.get(p, 0.0) for p in SCHED_PHASES),
            "num_transfers": self.num_transfers,
            "num_transfer_failed": self.num_transfer_failed,
            "num_bootstrap_failed": self.num_bootstrap_failed,
            "kv_transfer_latency_ms": _mean(self.transfer_ms),
            "phase_n": dict(self.phase_n),
        }


def _mean(values) -> float:
    return sum(values) / len(values) if values else 0.0
