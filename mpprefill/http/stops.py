"""Stop strings over streamed text: the text before the first stop string, released as
soon as it can no longer be the start of one.

The match is the stop string that ends first in the output, the longest of those ending
at the same place; so it is the same whichever way the output is cut into deltas. The
text held back is the longest tail of the output that begins some stop string (shorter
than the longest stop), so a feed looks at that tail and its delta only.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], no_stop_trim: bool = False):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.no_stop_trim = no_stop_trim
        self.matched: str | None = None
        self._starts = {s[:n] for s in self.stops for n in range(1, len(s))}
        self._longest = max(map(len, self.stops), default=0)
        self._held = ""

    @property
    def held(self) -> str:
        """The text fed but not yet released."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """The text that can be emitted now and the stop string once matched: the text
        ends just before it (with it, under `no_stop_trim`). Nothing after a match is
        emitted, and a match is reported once."""
        if self.matched is not None:
            return "", None
        text = self._held + delta
        hit = self._first_match(text)
        if hit is not None:
            end, self.matched = hit
            self._held = ""
            cut = end if self.no_stop_trim else end - len(self.matched)
            return text[:cut], self.matched
        keep = self._start_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """What is held when the output ends without a match."""
        out = self._held
        self._held = ""
        return out

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string to end in `text` ends, and which one it is."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
                best = (at + len(stop), -len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _start_len(self, text: str) -> int:
        """The length of the longest tail of `text` that begins a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            if text[-n:] in self._starts:
                return n
        return 0
