"""The HTTP front's API key (`--api-key`, SGLang's and vLLM's flag): every route but
`/health` answers 401 unless the request carries `Authorization: Bearer KEY`.

`/health` stays open so that a router's or an orchestrator's liveness probe needs no key
(sglang-router sends its `--api-key` on every other call to a worker, not on its health
checks). The key is compared in constant time. A server passes its key to its front child
in the environment (`API_KEY_ENV`), never on the command line, which `ps` shows anyone.
This module loads no web framework (the server imports it to spawn its front).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from mpprefill.http.errors import error_body

if TYPE_CHECKING:
    from fastapi import FastAPI

API_KEY_ENV = "MPPREFILL_API_KEY"
OPEN_PATHS = frozenset({"/health"})
_SCHEME = b"bearer "

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer ...` header (the scheme in any
    case), None without one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            if value[: len(_SCHEME)].lower() != _SCHEME:
                return None
            return value[len(_SCHEME) :].strip()
    return None


class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests outside OPEN_PATHS without the key get 401, with the
    front's error body, before any route (or the body) is read."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        await _unauthorized(send)

    def authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope)
        return token is not None and hmac.compare_digest(token, self._key)


async def _unauthorized(send: Send) -> None:
    body = json.dumps(error_body(401, "a valid API key is required: Authorization: Bearer KEY"))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """Guard `app` with `api_key`; None: every route stays open."""
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
