"""HTTP/1.1 rules of Training API v1 that hold for every route: CORS everywhere, JSON errors, body limits."""
from __future__ import annotations

import math
from typing import Callable, Optional

from aiohttp import web
from hivemind.utils.logging import get_logger

from dtrain.bridge.bodybuf import Body

logger = get_logger(__name__)

CORS_HEADERS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Content-Type, Content-Length, Authorization",  # contributor tokens (bridge/gate.py)
    "Access-Control-Expose-Headers": (
        "X-Model-Step, X-Tensor-Id, X-Tensor-Offset, X-Tensor-Count, X-Tensor-Format, X-Batch-Size, X-Seq-Len,"
        " Retry-After"  # a browser reads it from a 429 only when exposed
    ),
    "Access-Control-Max-Age": "86400",
}


class ApiError(Exception):
    """An answer other than 200, raised by handlers and turned into JSON at the boundary."""

    def __init__(self, status: int, message: str, server_step: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.server_step = status, message, server_step

    def response(self) -> web.Response:
        body = {"ok": False, "message": self.message}
        if self.server_step is not None:
            body["server_step"] = self.server_step
        return web.json_response(body, status=self.status)


async def _add_cors(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.update(CORS_HEADERS)


class RetryLater(ApiError):
    """An answer with Retry-After (whole seconds): 429 over a rate limit, 503 while the node holds too much."""

    def __init__(self, status: int, message: str, retry_after_s: float, server_step: Optional[int] = None):
        super().__init__(status, message, server_step=server_step)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def response(self) -> web.Response:
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after_s)
        return response


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own errors (unknown route, wrong method) answered as JSON like ours
        return web.json_response({"ok": False, "message": e.reason}, status=e.status)
    except Exception as e:  # a bug of ours: log it and answer without a traceback
        logger.exception(f"{request.method} {request.path} failed: {e}")
        return web.json_response({"ok": False, "message": "internal error"}, status=500)


@web.middleware
async def preflight_middleware(request: web.Request, handler):
    # Preflight answered here, not by a catch-all OPTIONS route: such a route matches every path, so
    # aiohttp answered GET/POST of an unknown path with 405 instead of 404.
    if request.method == "OPTIONS":
        return web.Response(status=204)
    return await handler(request)


def install(app: web.Application) -> None:
    app.middlewares.append(error_middleware)
    app.middlewares.append(preflight_middleware)
    app.on_response_prepare.append(_add_cors)


async def read_body(request: web.Request, max_body_bytes: int,
                    allocate: Callable[[int], Body] = bytearray) -> Body:
    """The request body, with the spec's 411 (no Content-Length) and 413 (too large) answers.

    Read into one buffer of exactly Content-Length bytes from `allocate`, allocated before the first byte arrives:
    request.read() gathers the chunks in a list and joins them, so each body briefly held twice its size in memory.
    Here a node with N uploads in flight holds the N bodies and one socket chunk each. A body cut short by the
    client is returned as what arrived, as request.read() did. DGRD packets pass `bodybuf.body_buffer` (huge pages,
    kept for the next bodies when a body is gone).
    """
    length = request.content_length
    if length is None:
        raise ApiError(411, "Content-Length required")
    if length > max_body_bytes:
        raise ApiError(413, f"body of {length} bytes exceeds the limit of {max_body_bytes} bytes")
    body = allocate(length)
    view = memoryview(body).cast("B")
    got = 0
    while got < length:
        chunk = await request.content.readany()
        if not chunk:
            del view
            return body[:got]
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    return body


def int_param(request: web.Request, name: str, default: Optional[int] = None, minimum: int = 0) -> Optional[int]:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ApiError(400, f"{name} must be >= {minimum}, got {value}")
    return value
