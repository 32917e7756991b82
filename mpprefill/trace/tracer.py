"""Span recorder: one per process, all on the system-wide monotonic clock.

NOTE: `time.monotonic_ns()` is `clock_gettime(CLOCK_MONOTONIC)` on Linux, one clock for every
process on the machine, so dumps from the scheduler and its spawned worker merge without any
offset. (`perf_counter_ns` reads the same clock on Linux, but not on every platform.)

Disabled, `span/instant` are plain module functions bound on the instance: no
clock read, no allocation of our own, one shared no-op context manager.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

clock_ns = time.monotonic_ns
_local = threading.local()  # per-thread cache: get_native_id() is a syscall (~150 ns)

# (name, tid, start_ns, dur_ns, seq, args or None); an instant has dur_ns == INSTANT.
Record = tuple[str, int, int, int, int, "dict | None"]
INSTANT = -1
DUMP_FORMAT = "mpprefill-trace/1"


def _thread_id() -> int:
    _local.tid = threading.get_native_id()
    return _local.tid


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # fixed arity: cheaper than *exc
        return None


NULL_SPAN = _NullSpan()


def _null_span(name, seq=-1, **args):
    return NULL_SPAN


def _null_instant(name, **args):
    return None


class _Span:
    __slots__ = ("tracer", "name", "seq", "args", "t0")

    def __init__(self, tracer: Tracer, name: str, seq: int, args: dict | None):
        self.tracer, self.name, self.seq, self.args = tracer, name, seq, args

    def __enter__(self) -> _Span:
        self.t0 = clock_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        t1 = clock_ns()
        record = (self.name, self.tracer._tid(), self.t0, t1 - self.t0, self.seq, self.args)
        self.tracer.records.append(record)


class Tracer:
    """Collects spans of this process; `dump()` writes them for `chrome.merge`."""

    def __init__(self, process_name: str, enabled: bool = False):
        self.process_name = process_name
        self.records: list[Record] = []
        self.threads: dict[int, str] = {}
        self.enabled = enabled

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = bool(on)
        if on:
            for attr in ("span", "instant"):
                self.__dict__.pop(attr, None)
        else:
            self.span = _null_span
            self.instant = _null_instant

    def span(self, name: str, seq: int = -1, **args) -> _Span:
        return _Span(self, name, seq, args or None)

    def record(self, name: str, start_ns: int, dur_ns: int, seq: int = -1) -> None:
        """A span measured by the caller on `clock_ns` (callers check `enabled` first)."""
        self.records.append((name, self._tid(), start_ns, dur_ns, seq, None))

    def instant(self, name: str, **args) -> None:
        self.records.append((name, self._tid(), clock_ns(), INSTANT, -1, args or None))

    def _tid(self) -> int:
        tid = getattr(_local, "tid", 0) or _thread_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def to_dump(self) -> dict:
        live = {t.native_id: t.name for t in threading.enumerate() if t.native_id in self.threads}
        return {
            "format": DUMP_FORMAT,
            "process_name": self.process_name,
            "pid": os.getpid(),
            "threads": {str(tid): live.get(tid, name) for tid, name in self.threads.items()},
            "records": [list(r) for r in self.records],
        }

    def dump_name(self) -> str:
        """Default file name of this process's dump inside a trace dir."""
        return f"{self.process_name}.{os.getpid()}.trace.json"

    def dump(self, path: str | os.PathLike) -> Path:
        """Write this process's records to a .json path, or as `dump_name()` in a directory."""
        path = Path(path)
        if path.is_dir() or path.suffix != ".json":
            path = path / self.dump_name()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dump(), separators=(",", ":")))
        tmp.replace(path)
        return path


_tracer = Tracer(f"pid{os.getpid()}", enabled=False)


def get_tracer() -> Tracer:
    return _tracer


def set_tracer(tracer: Tracer) -> Tracer:
    """Install `tracer` for this process; returns the previous one."""
    global _tracer
    prev, _tracer = _tracer, tracer
    return prev
