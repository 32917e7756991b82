"""Tracing: spans on one clock across processes, Chrome traces, overlap summary, timeline."""

from __future__ import annotations

from mpprefill.trace import chrome
from mpprefill.trace.summary import summarize
from mpprefill.trace.timeline import draw_timeline
from mpprefill.trace.tracer import get_tracer, set_tracer

__all__ = [
    "chrome",
    "draw_timeline",
    "get_tracer",
    "set_tracer",
    "summarize",
]
