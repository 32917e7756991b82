"""One request's output as its replies come: token ids, their logprobs where asked, and
its text, detokenized incrementally and cut at a stop string.

Stop strings are the front's: the servers behind it hold no tokenizer. A request with stop
strings is sent as streamed, so that its tokens come as they are made; the text they add
goes through the stop matcher, and once a stop string is matched the output ends there
(`stopped`): the caller aborts the request at the server, and the tokens after the one
that completed the stop string are dropped, as SGLang drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpprefill.http.detokenize import IncrementalDetokenizer
from mpprefill.http.stops import StopStrings
from mpprefill.http.tokenizer import TextTokenizer


@dataclass(slots=True)
class Delta:
    """What one reply added: its token ids (with their logprobs where asked) and text."""

    ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[list]] | None = None
    final: bool = False  # from the request's last reply


@dataclass(slots=True)
class Output:
    """The output so far. `text` is None without a tokenizer."""

    tokenizer: TextTokenizer | None
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    text: str | None = None
    matched: str | None = None  # the stop string that ended the output
    _detok: IncrementalDetokenizer | None = None
    _stops: StopStrings | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None:
            self.text = ""
            self._detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        if self.stops:
            self._stops = StopStrings(list(self.stops), no_stop_trim=self.no_stop_trim)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def full(self) -> bool:
        return len(self.ids) >= self.max_new_tokens

    def add(self, ids: list[int], reply: dict[str, Any], offset: int = 0) -> Delta | None:
        """Take the tokens of a reply (`ids` are its output_ids from `offset` on); None when
        nothing was added (the output is over, or the reply held no new token). A done
        reply's delta is `final`."""
        room = self.max_new_tokens - len(self.ids)
        if self.stopped or room <= 0 or not ids:
            return None
        ids = ids[:room]
        logprobs, top = _logprobs_of(reply, offset, len(ids))
        kept, text = [], ""
        for token in ids:
            kept.append(token)
            text += self._text_of(token)
            if self.stopped:
                break
        self.ids.extend(kept)
        delta = Delta(kept, text, final=reply.get("status") == "done")
        if logprobs is not None:
            delta.logprobs = logprobs[: len(kept)]
            self.logprobs.extend(delta.logprobs)
        if top is not None:
            delta.top_logprobs = top[: len(kept)]
            self.top_logprobs.extend(delta.top_logprobs)
        if self.text is not None:
            self.text += text
        return delta

    def _text_of(self, token: int) -> str:
        if self._detok is None:
            return ""
        return self._through_stops(self._detok.add([token]))

    def _through_stops(self, piece: str) -> str:
        if self._stops is None or not piece:
            return piece
        emit, matched = self._stops.feed(piece)
        if matched is not None:
            self.matched = matched
        return emit

    def finish(self) -> str:
        """The text held back at the end of the output: a character left incomplete, and
        what could have begun a stop string that did not come."""
        if self._detok is None or self.stopped:
            return ""
        rest = self._through_stops(self._detok.flush())
        if self._stops is not None and not self.stopped:
            rest += self._stops.flush()
        self.text += rest
        return rest

    def finish_reason(self, reply_reason: dict[str, Any] | None) -> dict[str, Any]:
        """SGLang's finish reason: the stop string matched, else the length limit once the
        output is full, else what the server said."""
        if self.matched is not None:
            return {"type": "stop", "matched": self.matched}
        if self.full or reply_reason is None:
            return {"type": "length", "length": len(self.ids)}
        return reply_reason


def _logprobs_of(reply: dict[str, Any], offset: int, n: int):
    """The reply's logprobs for its tokens `offset:offset + n` (None where not given)."""
    out = []
    for key in ("output_token_logprobs", "output_top_logprobs"):
        values = reply.get(key)
        out.append(values[offset : offset + n] if isinstance(values, list) else None)
    return out
