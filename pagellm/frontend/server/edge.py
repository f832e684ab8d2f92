"""The HTTP edge: what a client sends is bounded here, before any handler reads it.

The API key guards every route but OPEN_PATHS; a body is capped (`max_body_bytes`: 413);
its arrival time is bounded by the connection, for every route alike (connections.py:
a 408 at `ConnectionLimits.body_timeout_s`); it decodes into the route's typed body or
fails as a 400 naming why (invalid JSON, JSON nested too deeply, text that is not valid
Unicode, a field out of range). Errors keep OpenAI's shape,
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

# No API key needed: health checks (load balancers send no key) and metrics.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                    Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None
                   ) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def bad_request(message: str) -> APIError:
    return APIError(400, message, "BadRequestError")



class APIKeyGuard:
    """ASGI middleware: every route but OPEN_PATHS needs `Authorization: Bearer KEY`
    (unknown routes and the generated docs included, so nothing is learned without
    it)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: MutableMapping[str, Any],
                       receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "invalid or missing API key",
                                          "AuthenticationError")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413). No clock here: the connection's body
    deadline (connections.py) answers 408 and closes for every route, whether it reads
    its body or not, and a second clock here could only disagree with it. What this
    handler then sees is a disconnect."""
    length = request.headers.get("content-length", "")
    too_large = APIError(413, f"the request body is larger than {limit} bytes",
                         "RequestEntityTooLargeError")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody reads this answer; an APIError is handled quietly, where a
        # ClientDisconnect would be logged as an internal error, once per slow client.
        raise APIError(408, "the connection closed before the request body arrived",
                       "RequestTimeoutError") from None
    return b"".join(chunks)


def decode_body(data: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(data, type=kind)
    except RecursionError:
        raise bad_request("the body nests JSON too deeply") from None
    except UnicodeDecodeError as e:
        raise bad_request(f"the body is not valid UTF-8 (byte {e.start})") from None
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        path = _invalid_text_path(data)
        if path is not None:
            raise bad_request(f"{path}: not valid text (a lone surrogate)") from None
        raise bad_request(f"the body is not valid JSON: {e}") from None


def _invalid_text_path(data: bytes) -> str | None:
    """Where a JSON body (that the stdlib can parse) holds a string that is not valid
    Unicode: msgspec refuses those, rightly, but names no field."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None

    def walk(node: Any, path: str) -> str | None:
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(node, dict):
            for key, item in node.items():
                found = walk(item, f"{path}.{key}" if path else str(key))
                if found:
                    return found
        elif isinstance(node, list):
            for i, item in enumerate(node):
                found = walk(item, f"{path}[{i}]")
                if found:
                    return found
        return None

    try:
        return walk(value, "")
    except RecursionError:
        return None
