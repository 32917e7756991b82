"""Token ids to text as they arrive: each `add` returns only the text that is new.

The ids are decoded in a window: some ids of context, emitted already, then the ids not yet
emitted. The context makes the new piece read as it does inside the whole text (a decoder
that drops the leading space of a decode's first token, say); the new text is the window's
decode past the context's decode. The context starts where an emitted piece started (a
character boundary: a decoder of byte tokens decodes a run of them together, and a run
cut mid-character is all U+FFFD), the last such start at least CONTEXT ids back, or the
oldest one kept. A decode that ends in U+FFFD is an incomplete UTF-8 character, bytes
split across tokens: its ids are held until it completes. More than MAX_HELD held ids
(one long call, or a run of invalid bytes) are emitted up to the last character that ends
within their last PARTIAL_IDS ids, or all of them where none does. So a decode covers the
context, at most MAX_HELD held ids and the ids of one call, and the context is CONTEXT ids
and at most one earlier piece: the work of a call does not grow with the output.

    ids:    ... emitted ... | context | held | this call's ids |
    window:                 [--------------------------------)
    decode:                 [ prefix  )[ new text, unless it ends in U+FFFD
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpprefill.http.tokenizer import TextTokenizer

CONTEXT = 4
MAX_HELD = 8
PARTIAL_IDS = 3  # an incomplete character has at most 3 bytes, so at most 3 ids
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []
        self._starts = [0]  # piece boundaries in the window; the last: where held ids start
        self._prefix = ""  # the decode of the window up to the held ids
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All the text returned so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, ids: list[int]) -> str:
        """The text the new `ids` complete; "" while a character is incomplete."""
        if not ids:
            return ""
        self._window.extend(ids)
        full = self._decode(self._window)
        if not full.endswith(REPLACEMENT):
            return self._emit(len(self._window), full)
        if len(self._window) - self._starts[-1] <= MAX_HELD:
            return ""
        return self._emit(*self._last_complete(full))

    def flush(self) -> str:
        """What is held when the output ends (an incomplete character decodes as U+FFFD)."""
        if len(self._window) == self._starts[-1]:
            return ""
        return self._emit(len(self._window), self._decode(self._window))

    def _last_complete(self, full: str) -> tuple[int, str]:
        """Where a long held run that ends mid-character is cut, and the decode up to there."""
        last = len(self._window) - 1
        for end in range(last, max(self._starts[-1], last - PARTIAL_IDS), -1):
            text = self._decode(self._window[:end])
            if not text.endswith(REPLACEMENT):
                return end, text
        return len(self._window), full

    def _emit(self, end: int, full: str) -> str:
        """Returns the decode `full` of window[:end] past the context; window[:end] becomes
        emitted, and its tail from a piece's start the next context."""
        # NOTE: `full` starts with the context's decode for byte-level and SentencePiece
        # decoders; the new text is what follows it either way.
        new = full[len(self._prefix) :]
        self._starts.append(end)
        start = max((s for s in self._starts if end - s >= CONTEXT), default=self._starts[0])
        self._window = self._window[start:]
        self._starts = [s - start for s in self._starts if s >= start]
        self._prefix = self._decode(self._window[: end - start])
        self._pieces.append(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
