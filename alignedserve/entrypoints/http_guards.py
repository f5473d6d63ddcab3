"""ASGI middleware that stands between the network and the handlers: auth and body admission.

Both are plain ASGI (not ``BaseHTTPMiddleware``) so that they add no task or buffering per
request and leave streaming responses and disconnect detection untouched.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignedserve.entrypoints.openai_errors import INVALID_REQUEST, error_json

# After a body passes the limit we keep reading (and discarding) up to this much more, so a
# client that is still writing gets to read our 413 instead of a connection reset.
_DRAIN_BYTES = 16 << 20


class ApiKeyGuard:
    """Requires ``Authorization: Bearer <key>`` on every HTTP path except ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str,
                 open_paths: frozenset[str] = frozenset({"/health"})):
        self.app = app
        self._key = api_key.encode()
        self.open_paths = open_paths

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_json(401, "invalid or missing API key "
                              "(send 'Authorization: Bearer <key>')", INVALID_REQUEST,
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyGuard:
    """Reads each request body in full before the app runs, then replays it.

    Invariants: the app never sees a body longer than ``max_bytes`` (413 instead) nor one that
    is not valid UTF-8 (400 instead: JSON must be UTF-8, RFC 8259); after the replayed body,
    ``receive`` is the server's own, so handlers still learn of client disconnects.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, status = await self._read(receive)
        if status == "gone":
            return
        if status == "too_large":
            await error_json(413, f"request body exceeds {self.max_bytes} bytes",
                             code="request_too_large",
                             headers={"Connection": "close"})(scope, receive, send)
            return
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await error_json(400, f"request body is not valid UTF-8 (byte {exc.start})",
                             code="invalid_encoding")(scope, receive, send)
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _read(self, receive: Receive) -> tuple[bytearray, str]:
        body = bytearray()
        seen = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return body, "gone"
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen <= self.max_bytes:
                body += chunk
            more = message.get("more_body", False)
            if seen > self.max_bytes and (not more or seen > self.max_bytes + _DRAIN_BYTES):
                return body, "too_large"
            if not more:
                return body, "ok"


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
