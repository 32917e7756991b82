"""The cyclic GC's pauses, and freezing the heap after warm-up.

With torch imported a full (gen-2) collection walks every tracked object of the process,
some hundreds of thousands, and stops the scheduler's thread while it does. `GcWatch`
times each collection through `gc.callbacks`; `freeze_heap()` moves everything alive
after warm-up to the permanent generation, which later collections skip.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass

from mpprefill.trace.tracer import clock_ns, get_tracer

GENERATIONS = 3
RECENT_GEN2 = 64  # recent gen-2 pauses kept (they travel in JSON reports)


@dataclass(slots=True)
class GenPauses:
    """Pauses of one generation's collections."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)

    def to_dict(self) -> dict:
        return {"count": self.count, "total_ms": self.total_s * 1e3, "max_ms": self.max_s * 1e3}


class GcWatch:
    """`watch = GcWatch().install()` ... `watch.uninstall()`; or `with GcWatch() as watch:`.

    Each collection is also a span `gc<generation>` while the process's tracer is enabled.
    """

    def __init__(self, recent: int = RECENT_GEN2):
        self.gens = [GenPauses() for _ in range(GENERATIONS)]
        self.recent_gen2_s: deque[float] = deque(maxlen=recent)
        self._start_ns: int | None = None

    @property
    def installed(self) -> bool:
        return self._on_gc in gc.callbacks

    def install(self) -> GcWatch:
        if not self.installed:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._on_gc)
        self._start_ns = None

    def _on_gc(self, phase: str, info: dict) -> None:
        # NOTE: runs twice in every collection, gen-0 ones included: keep it cheap.
        if phase == "start":
            self._start_ns = clock_ns()
            return
        start = self._start_ns
        if start is None:  # a stop without its start: installed mid-collection
            return
        self._start_ns = None
        dur = clock_ns() - start
        gen = info["generation"]
        self.gens[gen].add(dur / 1e9)
        if gen == GENERATIONS - 1:
            self.recent_gen2_s.append(dur / 1e9)
        tracer = get_tracer()
        if tracer.enabled:
            tracer.record(f"gc{gen}", start, dur)

    def to_dict(self) -> dict:
        out = {f"gen{i}": g.to_dict() for i, g in enumerate(self.gens)}
        out["recent_gen2_ms"] = [s * 1e3 for s in self.recent_gen2_s]
        return out

    def __enter__(self) -> GcWatch:
        return self.install()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.uninstall()


def freeze_heap() -> int:
    """Collect, then move every survivor to the permanent generation; returns the number
    of objects there. Call it after warm-up, when what is alive is what stays alive."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
