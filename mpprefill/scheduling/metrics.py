"""Scheduler-side counters: phase times, forward times, hand-off gaps, finished-request
totals.

The hand-off gap of forward N + 1 is how long the device sat idle between forward N's
end and forward N + 1's start although batch N + 1 was already built when N ended: the
time the hand-off itself costs, not a wait for work.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from mpprefill.trace.tracer import clock_ns, get_tracer

TRACE_NAMES = {"collect": "collect-wait"}
MAX_GAPS = 4096  # recent hand-off gaps kept for medians (they travel in stats replies)


@dataclass
class SchedulerMetrics:
    phase_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    phase_n: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    num_batches: int = 0
    forward_s: float = 0.0  # host time of the forward calls (issue)
    device_s: float = 0.0  # the device's busy time in the forwards
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
        self.batch_tokens += fb.num_tokens
        built = self._built_ns.pop(result.seq, None)
        prev_seq, prev_end = self._last_end
        if prev_seq == result.seq - 1 and built is not None and built <= prev_end:
            self.handoff_n += 1
            self.handoff_gaps_s.append(max(0, result.start_ns - prev_end) / 1e9)
        self._last_end = (result.seq, result.end_ns)

    def on_finish(self, req) -> None:
        if req.error:
            self.num_failed += 1
            return
        self.num_finished += 1
        self.prompt_tokens += req.prompt_len
        self.cached_tokens += req.cached_tokens

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict:
        mb = self.mailbox_bytes
        return {
            "mailbox_bytes_per_batch": {
                "mean": sum(mb) / len(mb) if mb else 0.0,
                "max": max(mb, default=0),
            },
            "num_batches": self.num_batches,
            "forward_s": self.forward_s,
            "device_s": self.device_s,
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
            "phase_n": dict(self.phase_n),
        }
