"""How much of the forward the scheduler hid its own work behind, from one run's trace.

All figures come from interval arithmetic on spans clipped to the run window (by default the
first to the last event), never from sums of overlapping spans:

- overlap_frac:     |F ∩ W| / |F|, F = union of forward spans (any lane), W = union of
                    scheduler-work spans on the scheduler lane.
- bubbles_s:        |gaps(F) ∩ waiting|, gaps between the first and the last forward, waiting =
                    time during which the last queue sample said waiting > 0.
- worker_busy_frac: |F| / wall.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from mpprefill.trace import chrome
from mpprefill.trace.tracer import Tracer

FORWARD = "forward"
SCHED_WORK = ("build", "process", "sample", "snapshot", "early-send", "inflight")
QUEUE = "queue"  # instant with arg `waiting`, emitted by the scheduler
Interval = tuple[int, int]
Lane = tuple[int, int]  # (pid, tid)


def union(ivs: Iterable[Interval]) -> list[Interval]:
    out: list[list[int]] = []
    for s, e in sorted(iv for iv in ivs if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sorted, disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(ivs: Sequence[Interval]) -> list[Interval]:
    """Holes between consecutive intervals of a sorted, disjoint list."""
    return [(a[1], b[0]) for a, b in zip(ivs, ivs[1:]) if b[0] > a[1]]


def length(ivs: Iterable[Interval]) -> int:
    return sum(e - s for s, e in ivs)


def waiting_intervals(samples: Iterable[tuple[int, int]], end_ns: int) -> list[Interval]:
    """Where a step function of (t_ns, num_waiting) samples is > 0; each holds until the next."""
    pts = sorted(samples)
    ends = [t for t, _ in pts[1:]] + [end_ns]
    return union((t, e) for (t, n), e in zip(pts, ends) if n > 0)


def scheduler_lane(spans: Iterable[chrome.Span]) -> Lane | None:
    """The lane (pid, tid) with the most scheduler-work spans: the scheduler's main thread."""
    counts = Counter((s.pid, s.tid) for s in spans if s.name in SCHED_WORK and not s.instant)
    return counts.most_common(1)[0][0] if counts else None


@dataclass
class OverlapSummary:
    wall_s: float
    forward_s: float
    num_batches: int
    overlap_frac: float
    bubbles_s: float
    collect_wait_s: float
    worker_busy_frac: float
    phase_s: dict[str, float]
    phase_per_batch_ms: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"wall {self.wall_s:.3f} s   batches {self.num_batches}   "
            f"forward {self.forward_s:.3f} s   worker busy {self.worker_busy_frac:6.1%}",
            f"overlap {self.overlap_frac:6.1%}   bubbles {self.bubbles_s:.4f} s   "
            f"collect-wait {self.collect_wait_s:.4f} s",
            f"{'phase':<12}{'total s':>10}{'ms/batch':>10}",
        ]
        for name, sec in sorted(self.phase_s.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name:<12}{sec:>10.4f}{self.phase_per_batch_ms[name]:>10.3f}")
        return "\n".join(lines)


def _clip(spans: Iterable[chrome.Span], lo: int, hi: int) -> list[tuple[chrome.Span, Interval]]:
    out = []
    for s in spans:
        a, b = max(s.start_ns, lo), min(s.end_ns, hi)
        if b > a:
            out.append((s, (a, b)))
    return out


def _samples(instants: Iterable[chrome.Span]) -> list[tuple[int, int]]:
    return [(s.start_ns, int(s.args["waiting"])) for s in instants if s.name == QUEUE and s.args]


def _phases(clipped, lane: Lane | None, num_batches: int) -> tuple[dict, dict]:
    total: dict[str, int] = defaultdict(int)
    for s, (a, b) in clipped:
        if (s.pid, s.tid) == lane and s.name != FORWARD:
            total[s.name] += b - a
    per_batch = {k: v / 1e6 / max(num_batches, 1) for k, v in total.items()}
    return {k: v / 1e9 for k, v in total.items()}, per_batch


def summarize(
    source: str | os.PathLike | list | Tracer,
    *,
    queue_samples: Iterable[tuple[int, int]] | None = None,
    window_ns: tuple[int, int] | None = None,
) -> OverlapSummary:
    """Summarise one run: a merged trace or dump path, chrome events, or tracers in memory.

    queue_samples: (t_ns on the tracer clock, num_waiting); default: the `queue` instants.
    """
    trace = chrome.read(source)
    spans = [s for s in trace.spans if not s.instant]
    if window_ns is None and trace.spans:
        window_ns = (min(s.start_ns for s in trace.spans), max(s.end_ns for s in trace.spans))
    lo, hi = window_ns or (0, 0)
    clipped = _clip(spans, lo, hi)
    lane = scheduler_lane(spans)
    fwd = union(iv for s, iv in clipped if s.name == FORWARD)
    work = union(iv for s, iv in clipped if s.name in SCHED_WORK and (s.pid, s.tid) == lane)
    samples = _samples(trace.spans) if queue_samples is None else list(queue_samples)
    bubbles = intersect(gaps(fwd), waiting_intervals(samples, hi))
    num_batches = sum(1 for s, _ in clipped if s.name == FORWARD)
    phase_s, per_batch = _phases(clipped, lane, num_batches)
    wall, busy = hi - lo, length(fwd)
    return OverlapSummary(
        wall_s=wall / 1e9,
        forward_s=busy / 1e9,
        num_batches=num_batches,
        overlap_frac=length(intersect(fwd, work)) / busy if busy else 0.0,
        bubbles_s=length(bubbles) / 1e9,
        collect_wait_s=sum(b - a for s, (a, b) in clipped if s.name == "collect-wait") / 1e9,
        worker_busy_frac=busy / wall if wall else 0.0,
        phase_s=phase_s,
        phase_per_batch_ms=per_batch,
    )
