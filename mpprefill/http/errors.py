"""HTTP status codes for the front's own refusals and for the server's error replies.

Bodies are SGLang's `/generate` error shape with the status added:
`{"error": {"message": "...", "code": 400}}`.

An error reply's status is its `code` (`protocol.Code`: the HTTP status the server gave
it). A reply without one (a server that sends no codes) falls back to its reason's opening
words:

| reason starts with                                   | status |
|------------------------------------------------------|--------|
| overloaded                                           | 429    |
| server shutting down                                 | 503    |
| frame of N bytes exceeds                             | 413    |
| empty input_ids, token id, prompt of, input_ids,     | 400    |
| sampling_params, bootstrap_room, duplicate rid, ...  |        |
| anything else (worker, transfer, bootstrap failures) | 500    |
"""

from __future__ import annotations

from typing import Any

from mpprefill.protocol import ABORTED, Code

_STATUSES = frozenset((400, 413, 429, 500, 503))

_BY_PREFIX: tuple[tuple[str, int], ...] = (
    ("overloaded", 429),
    ("server shutting down", 503),
    ("frame of ", 413),
    ("empty input_ids", 400),
    ("token id ", 400),
    ("prompt of ", 400),
    ("input_ids ", 400),
    ("sampling_params", 400),
    ("bootstrap_", 400),
    ("stream must", 400),
    ("duplicate rid", 400),
    ("rid longer than", 400),
    ("generate needs", 400),
    ("unknown fields", 400),
    ("frame is not", 400),
)


class HttpError(Exception):
    """A request the front answers with `status` and an error body."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "code": status}}


def is_abort(reply: dict[str, Any]) -> bool:
    """An error reply for a request its client (or /abort_request) aborted."""
    code = reply.get("code")
    return code == Code.ABORTED if code is not None else reply.get("error") == ABORTED


def status_of(reason: str, code: Any = None) -> int:
    """The HTTP status of a server's error reply: its code, else read from its reason."""
    if type(code) is int:
        return code if code in _STATUSES else (400 if 400 <= code < 500 else 500)
    return next((status for prefix, status in _BY_PREFIX if reason.startswith(prefix)), 500)


def from_reply(reply: dict[str, Any]) -> HttpError:
    reason = str(reply.get("error", "a reply without a status"))
    return HttpError(status_of(reason, reply.get("code")), reason)


def bad_request(message: str) -> HttpError:
    return HttpError(400, message)
