"""Bearer-token auth and a request-body limit for opsd's HTTP APIs (one ASGI middleware).

`ApiGuard` sits in front of an app. Every path except /health, /metrics,
/readyz and /livez (probes and Prometheus scrape carry no secret) needs
`Authorization: Bearer <token>`, the OpenAPI schema and docs included; a
missing or wrong token, or more than one Authorization header, gets 401
with `WWW-Authenticate: Bearer`. A body
larger than the limit gets 413 whether it announces itself (Content-Length)
or not (chunked, or a Content-Length that lies): the guard counts the bytes
actually received and stops reading past the limit. Every refusal has a
JSON `{"detail": reason}` and is counted in opsd_http_rejected_total{role,status}.

The token is per run: `opsd run` generates one and passes it to every role
in OPSD_API_TOKEN.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from opsd import metrics

TOKEN_ENV = "OPSD_API_TOKEN"
OPEN_PATHS = frozenset({"/health", "/metrics", "/readyz", "/livez"})
MIN_TOKEN_CHARS = 16  # `opsd run` generates 43 (secrets.token_urlsafe(32)); a short one is guessable


def api_token(env: Mapping[str, str] = os.environ) -> str:
    """The run's API token from OPSD_API_TOKEN.

    Raises RuntimeError (with what to do) when it is unset, shorter than
    MIN_TOKEN_CHARS, or not printable ASCII (it travels in an HTTP header).
    """
    token = env.get(TOKEN_ENV, "")
    if not token:
        raise RuntimeError(f"{TOKEN_ENV} is not set: an opsd HTTP API never runs without a token "
                           f"(`opsd run` generates one; when starting a role by hand, export a random one)")
    if len(token) < MIN_TOKEN_CHARS or not (token.isascii() and token.isprintable()) or " " in token:
        raise RuntimeError(f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces")
    return token


class ApiGuard:
    """ASGI middleware: bearer-token check, then body-size limit, then the wrapped app.

    `token`: the expected bearer token (compared in constant time).
    `max_body_bytes`: the largest request body accepted, in bytes.
    The body is read here, up to the limit, and handed to the app in one
    message (the app's JSON parsing needs all of it anyway). Raises
    ValueError at construction for an empty token or a limit < 1.
    """

    def __init__(self, app: ASGIApp, *, role: str, token: str, max_body_bytes: int,
                 open_paths: frozenset[str] = OPEN_PATHS):
        if not token:
            raise ValueError("ApiGuard needs a non-empty token")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.role = role
        self._token = token.encode()
        self.max_body_bytes = max_body_bytes
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to guard
            await self.app(scope, receive, send)
            return
        # Lower-cased names. Of a repeated header dict() keeps the LAST value: fine for Content-Length
        # (the server refuses conflicting copies), not for Authorization, checked on all copies below.
        headers = dict(scope["headers"])
        if scope["path"] not in self.open_paths:
            # Exactly one: with two, the app and any proxy in front could each read a different one.
            auth = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(auth) > 1:
                await self._refuse(scope, receive, send, 401, "more than one Authorization header",
                                   {"WWW-Authenticate": "Bearer"})
                return
            if not self._authorized(auth[0] if auth else b""):
                await self._refuse(scope, receive, send, 401, "missing or wrong bearer token",
                                   {"WWW-Authenticate": "Bearer"})
                return
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._refuse(scope, receive, send, 400, "Content-Length is not a number")
                return
            if int(declared) > self.max_body_bytes:
                await self._refuse(scope, receive, send, 413, self._too_large(int(declared)))
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # chunked, or more than Content-Length said
                await self._refuse(scope, receive, send, 413, self._too_large(size, streamed=True))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        await self.app(scope, replay, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, presented = header.partition(b" ")
        # compare_digest's time does not depend on where the bytes differ (only on the length).
        return scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), self._token)

    def _too_large(self, size: int, streamed: bool = False) -> str:
        what = f"more than {self.max_body_bytes} bytes sent" if streamed else f"a body of {size} bytes"
        return f"request body too large: {what}; the limit is {self.max_body_bytes} bytes"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, reason: str,
                      headers: dict[str, str] | None = None) -> None:
        metrics.HTTP_REJECTED.labels(self.role, str(status)).inc()
        await JSONResponse({"detail": reason}, status_code=status, headers=headers)(scope, receive, send)
