"""Tracing: spans on one clock across processes, Chrome traces, overlap summary, timeline."""

from __future__ import annotations

from mpprefill.trace import chrome
from mpprefill.trace.summary import OverlapSummary, summarize
from mpprefill.trace.tracer import Tracer, get_tracer, set_tracer

__all__ = [
    "OverlapSummary",
    "Tracer",
    "chrome",
    "get_tracer",
    "set_tracer",
    "summarize",
]


def draw_timeline(*args, **kwargs):
    """See `mpprefill.trace.timeline.draw_timeline` (needs the `plot` extra)."""
    from mpprefill.trace.timeline import draw_timeline as draw

    return draw(*args, **kwargs)
