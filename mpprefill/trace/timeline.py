"""PNG timeline: per mode, the scheduler's main thread above the forward (thread or process).

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch);
matplotlib is the optional `plot` extra and is imported only here, when drawing.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpprefill.trace import chrome
from mpprefill.trace.summary import FORWARD, scheduler_lane

PHASE_COLORS = {
    "build": "#4c72b0",
    "forward": "#dd8452",
    "process": "#55a868",
    "sample": "#c44e52",
    "snapshot": "#8172b3",
    "submit": "#937860",
    "collect-wait": "#c7c7c7",
    "early-send": "#da8bc3",
    "inflight": "#8c8c8c",
    "transfer": "#ccb974",
}
EXTRA_COLORS = ("#64b5cd", "#a1c9f4", "#ffb482", "#8de5a1", "#ff9f9b", "#d0bbff", "#debb9b")
Window = tuple[float, float] | int


def _matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "drawing a timeline needs matplotlib, the optional 'plot' extra: "
            "pip install 'mpprefill[plot]'"
        ) from e
    return Figure, Patch


def pick_window(spans: list[chrome.Span], window: Window) -> tuple[int, int]:
    """(start_frac, end_frac) of the run, or n forward iterations from the middle of it."""
    lo, hi = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
    if not isinstance(window, int):
        f0, f1 = window
        return lo + int(f0 * (hi - lo)), lo + int(f1 * (hi - lo))
    fwd = sorted((s for s in spans if s.name == FORWARD), key=lambda s: s.start_ns)
    if len(fwd) <= window:
        return lo, hi
    i0 = len(fwd) // 2 - window // 2
    a, b = fwd[i0].start_ns, fwd[i0 + window - 1].end_ns
    pad = (b - a) // 20
    return max(lo, a - pad), min(hi, b + pad)


def split_lanes(trace: chrome.Trace) -> tuple[list, list, str]:
    """Spans of the scheduler lane, spans of the forward lane(s), and the forward lane's label."""
    spans = [s for s in trace.spans if not s.instant]
    sched = scheduler_lane(spans)
    on_sched = [s for s in spans if (s.pid, s.tid) == sched]
    fwd_lanes = {(s.pid, s.tid) for s in spans if s.name == FORWARD} - {sched}
    if not fwd_lanes:
        return on_sched, [s for s in on_sched if s.name == FORWARD], "forward (sched thread)"
    worker = [s for s in spans if (s.pid, s.tid) in fwd_lanes]
    label = "forward thread" if sched and {p for p, _ in fwd_lanes} == {sched[0]} else "worker"
    return on_sched, worker, label


def _depths(spans: list[chrome.Span]) -> list[tuple[chrome.Span, int]]:
    out, ends = [], []
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        while ends and ends[-1] <= s.start_ns:
            ends.pop()
        out.append((s, len(ends)))
        ends.append(s.end_ns)
    return out


def _color(name: str, extra: dict[str, str]) -> str:
    if name not in PHASE_COLORS and name not in extra:
        extra[name] = EXTRA_COLORS[len(extra) % len(EXTRA_COLORS)]
    return PHASE_COLORS.get(name) or extra[name]


def _draw_lane(ax, spans, y: float, win: tuple[int, int], colors: dict[str, str]) -> set[str]:
    lo, hi = win
    seen = set()
    for s, depth in sorted(_depths(spans), key=lambda sd: sd[1]):
        a, b = max(s.start_ns, lo), min(s.end_ns, hi)
        if b <= a:
            continue
        h = max(0.8 - 0.2 * depth, 0.2)
        bar = [((a - lo) / 1e6, (b - a) / 1e6)]
        ax.broken_barh(bar, (y - h / 2, h), facecolors=_color(s.name, colors), edgecolor="none")
        seen.add(s.name)
    return seen


def draw_timeline(
    traces: dict[str, str | os.PathLike | list],
    out_png: str | os.PathLike,
    window: Window = 4,
    *,
    title: str | None = None,
) -> Path:
    """Draw each mode's two lanes over a steady-state window; modes stacked, one legend."""
    Figure, Patch = _matplotlib()
    fig = Figure(figsize=(12, 1.4 * len(traces) + 1.2), dpi=110)
    axes = fig.subplots(len(traces), 1, sharex=True, squeeze=False)[:, 0]
    colors: dict[str, str] = {}
    names: set[str] = set()
    for ax, (mode, src) in zip(axes, traces.items()):
        trace = chrome.read(src)
        sched, worker, label = split_lanes(trace)
        spans = [s for s in trace.spans if not s.instant]
        win = pick_window(spans, window) if spans else (0, 1)
        names |= _draw_lane(ax, sched, 1.0, win, colors)
        names |= _draw_lane(ax, worker, 0.0, win, colors)
        ax.set_yticks([1.0, 0.0], ["scheduler", label])
        ax.set_ylim(-0.6, 1.6)
        ax.set_title(mode, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms (from the window start)")
    order = [n for n in PHASE_COLORS if n in names] + sorted(names - set(PHASE_COLORS))
    handles = [Patch(color=_color(n, colors), label=n) for n in order]
    ncol = max(min(len(handles), 10), 1)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    inch = 1 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0.45 * inch, 1, 1 - (0.2 * inch if title else 0)))
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
