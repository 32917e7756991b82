"""HTTP status codes for the front's own refusals and for the scheduler's error replies.

Bodies are SGLang's `/generate` error shape with the status added:
`{"error": {"message": "...", "code": 400}}`.

The request protocol's error replies carry a reason only, no code, so the status is read
from the reason's opening words (the reasons server.py, scheduler.py and protocol.py give):

| reason starts with                                   | status |
|------------------------------------------------------|--------|
| overloaded, server shutting down                     | 503    |
| frame of N bytes exceeds                             | 413    |
| empty input_ids, token id, prompt of, input_ids,     | 400    |
| sampling_params, bootstrap_room, duplicate rid, ...  |        |
| anything else (worker, transfer, bootstrap failures) | 500    |
"""

from __future__ import annotations

ABORTED = "aborted by client"  # the scheduler's reason for a request /abort_request ended
# NOTE: the scheduler's only reply to an abort of a rid it does not hold; no generate ever
# fails with it, so the link drops it instead of routing it to a request of that rid.
UNKNOWN_RID = "unknown rid"

_BY_PREFIX: tuple[tuple[str, int], ...] = (
    ("overloaded", 503),
    ("server shutting down", 503),
    ("frame of ", 413),
    ("empty input_ids", 400),
    ("token id ", 400),
    ("prompt of ", 400),
    ("input_ids ", 400),
    ("sampling_params", 400),
    ("bootstrap_room ", 400),
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


def status_of(reason: str) -> int:
    """The HTTP status of a scheduler's error reply."""
    return next((code for prefix, code in _BY_PREFIX if reason.startswith(prefix)), 500)


def from_reply(reason: str) -> HttpError:
    return HttpError(status_of(reason), reason)


def bad_request(message: str) -> HttpError:
    return HttpError(400, message)
