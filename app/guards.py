"""What a request passes before any route sees it: the API key, then the body size.

Both are plain ASGI middleware answering in OpenAI's error body. The key is checked first, so a
client without it cannot make the ingress read a large body. The body limit holds whether the
client announces the size (`Content-Length`, refused before a byte is read) or streams it
(chunked: refused as soon as the running total passes the limit); the body is read, up to the
limit, before the route parses any JSON.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.protocol import APIError

# The default body limit: room for a chat request's JSON around a prompt of max_model_len
# tokens, however it is written. A token is a few characters of text, or an id of up to six
# digits in a list; a character escaped in JSON (`\uXXXX`, a surrogate pair for an emoji) is up
# to 12 bytes.
BODY_BYTES_BASE = 1 << 20
BODY_BYTES_PER_TOKEN = 32
FALLBACK_MAX_MODEL_LEN = 32768  # when the model's context length is not known


def default_body_limit(max_model_len: int | None) -> int:
    """1 MiB plus 32 bytes per token of context."""
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * (max_model_len or FALLBACK_MAX_MODEL_LEN)


async def send_error(send: Send, error: APIError, headers: dict[str, str] | None = None) -> None:
    body = error.to_response().model_dump_json().encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _path(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


class ApiKeyGuard:
    """Every path under one of `prefixes` requires `Authorization: Bearer <key>`; else 401.

    The comparison takes the same time whatever the header holds: both sides are hashed to the
    same length before a constant-time compare, so neither the key's content nor its length
    leaks through timing."""

    def __init__(self, app: ASGIApp, *, api_key: str, prefixes: Iterable[str] = ("/v1/",)):
        self.app = app
        self.prefixes = tuple(prefixes)
        self._expected = hashlib.sha256(b"Bearer " + api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _path(scope).startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        given = hashlib.sha256(_header(scope, b"authorization") or b"").digest()
        if not hmac.compare_digest(given, self._expected):
            error = APIError(
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                401,
                code="invalid_api_key",
            )
            await send_error(send, error, {"www-authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies over `max_bytes` are answered 413, whole bodies under it are read before
    the app runs (the app then gets them in one message, then the client's later messages,
    such as `http.disconnect`, as they come)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size < 0:
                await send_error(send, APIError("the Content-Length header is not a number"))
                return
            if size > self.max_bytes:
                await send_error(send, self._too_large())
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await send_error(send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            f"the request body is larger than this server accepts ({self.max_bytes} bytes; the "
            "app arg max_request_body_bytes)",
            413,
            code="request_too_large",
        )
