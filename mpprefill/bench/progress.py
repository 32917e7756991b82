"""A minimal progress bar on stderr: redrawn with \\r on a terminal, one final line otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m}:{s:02d}" if m else f"{s}s"


class Progress:
    """`Progress(total, desc)`; `update(n)` as work finishes, `close()` at the end."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        file: TextIO | None = None,
        min_interval_s: float = 0.1,
    ):
        self.total, self.desc, self.count = max(int(total), 0), desc, 0
        self.file = file if file is not None else sys.stderr
        self.tty = bool(getattr(self.file, "isatty", lambda: False)())
        self.min_interval_s = min_interval_s
        self.t0 = self._last = time.monotonic()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if self.tty and (now - self._last >= self.min_interval_s or self.count >= self.total):
            self._last = now
            self._write("\r" + self.line(now) + "\x1b[K")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._write(("\r" if self.tty else "") + self.line(time.monotonic()) + "\n")

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.t0, 1e-9)
        rate = self.count / elapsed
        left = (self.total - self.count) / rate if rate > 0 else float("inf")
        frac = min(self.count / self.total, 1.0) if self.total else 1.0
        fill = int(frac * BAR_WIDTH)
        bar = "#" * fill + "." * (BAR_WIDTH - fill)
        head = f"{self.desc}: " if self.desc else ""
        tail = f"ETA {_duration(left)}" if self.count < self.total else _duration(elapsed)
        return f"{head}[{bar}] {self.count}/{self.total} {rate:.1f}/s {tail}"

    def _write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
