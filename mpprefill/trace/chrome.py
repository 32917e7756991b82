"""Chrome trace JSON: merge per-process dumps into one file that Perfetto opens.

Spans become "X" events on their thread. Times are microseconds after the earliest event; the
clock value of that origin is kept in `otherData.t0_ns`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mpprefill.trace.tracer import DUMP_FORMAT, INSTANT, Tracer


@dataclass(frozen=True, slots=True)
class Span:
    """One span or instant (end_ns == start_ns) in absolute clock ns."""

    name: str
    pid: int
    tid: int
    start_ns: int
    end_ns: int
    args: dict | None = None
    instant: bool = False


def read_dump(path: str | os.PathLike) -> dict:
    dump = json.loads(Path(path).read_text())
    if dump.get("format") != DUMP_FORMAT:
        raise ValueError(f"{path}: not a tracer dump ({DUMP_FORMAT})")
    return dump


def _origin(dumps: list[dict]) -> int:
    return min((r[2] for d in dumps for r in d["records"]), default=0)


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def _event(rec: list, pid: int, tid: int, t0: int) -> dict:
    name, _, start, dur, seq, args = rec
    args = dict(args or {})
    if seq >= 0:
        args["seq"] = seq
    ev = {"name": name, "pid": pid, "tid": tid, "ts": _us(start - t0), "args": args}
    if dur == INSTANT:
        ev.update(ph="i", s="t")
    else:
        ev.update(ph="X", dur=_us(dur))
    return ev


def _meta(kind: str, pid: int, tid: int, **args) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def dump_events(dumps: list[dict]) -> tuple[list[dict], int]:
    """Chrome events of several dumps (one per process) and the origin they share."""
    t0 = _origin(dumps)
    events = []
    for sort_index, dump in enumerate(dumps):
        pid = dump["pid"]
        events.append(_meta("process_name", pid, 0, name=dump["process_name"]))
        events.append(_meta("process_sort_index", pid, 0, sort_index=sort_index))
        for tid, name in dump["threads"].items():
            events.append(_meta("thread_name", pid, int(tid), name=name))
        events.extend(_event(r, pid, r[1], t0) for r in dump["records"])
    return events, t0


def merge(paths: Iterable[str | os.PathLike], out_path: str | os.PathLike) -> Path:
    """Merge tracer dumps (one per process) into one Chrome trace JSON file."""
    events, t0 = dump_events([read_dump(p) for p in paths])
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0_ns": t0}}
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out


def _parse(data: dict | list) -> tuple[list[dict], int]:
    if isinstance(data, list):
        return data, 0
    if data.get("format") == DUMP_FORMAT:
        return dump_events([data])
    return data["traceEvents"], int(data.get("otherData", {}).get("t0_ns", 0))


def to_spans(events: Iterable[dict], t0_ns: int = 0) -> list[Span]:
    """X and instant events as `Span`s in clock ns (t0_ns: the trace's origin)."""
    spans = []
    for ev in events:
        if ev.get("ph") not in ("X", "i", "I"):
            continue
        start = t0_ns + round(ev["ts"] * 1000)
        end = start + round(ev.get("dur", 0) * 1000)
        instant = ev["ph"] != "X"
        spans.append(Span(ev["name"], ev["pid"], ev["tid"], start, end, ev.get("args"), instant))
    return spans


@dataclass
class Trace:
    """Spans of one run with the names of its threads."""

    spans: list[Span]
    threads: dict[tuple[int, int], str]

    @classmethod
    def from_events(cls, events: list[dict], t0_ns: int = 0) -> Trace:
        threads = {}
        for ev in events:
            if ev.get("ph") == "M" and ev["name"] == "thread_name":
                threads[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        return cls(to_spans(events, t0_ns), threads)


def read(source: str | os.PathLike | list | dict | Tracer) -> Trace:
    """A `Trace` from a merged trace or dump path, chrome events, or tracers/dumps in memory.

    Chrome events without `otherData` keep microseconds after their own origin.
    """
    if isinstance(source, (str, os.PathLike)):
        return Trace.from_events(*_parse(json.loads(Path(source).read_text())))
    items = source if isinstance(source, list) else [source]
    if items and all(isinstance(x, (Tracer, dict)) and not _is_event(x) for x in items):
        dumps = [x.to_dump() if isinstance(x, Tracer) else x for x in items]
        events, t0 = dump_events(dumps)
        return Trace.from_events(events, t0)
    return Trace.from_events(list(items))


def _is_event(x) -> bool:
    return isinstance(x, dict) and "ph" in x
