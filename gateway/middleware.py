"""Pure ASGI middleware (no BaseHTTPMiddleware: it buffers streaming bodies
and breaks SSE): the request-body limit and Prometheus HTTP metrics."""

from __future__ import annotations

import json
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import RequestTooLarge, error_body
from services.core.context import request_id_var
from services.core.metrics import HTTP_LATENCY, HTTP_REQUESTS

__all__ = ["BodyLimitMiddleware", "MetricsMiddleware", "RequestIdMiddleware"]

_MAX_REQUEST_ID_LEN = 128


async def _send_too_large(send: Send, *, close: bool) -> None:
    body = json.dumps(
        error_body("Request body exceeds the size limit.", "invalid_request_error", "request_too_large")
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    """Reads and discards the rest of a request body."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class BodyLimitMiddleware:
    """Rejects bodies over ``max_bytes`` with 413 ``request_too_large``: before
    the app runs when Content-Length says so, otherwise while the body streams
    in (chunked uploads do not declare a length).

    A client that is still sending its body reads the 413 only if the server
    consumes that body before it closes: closing a socket with unread data
    resets the connection, and the client sees a connection error instead
    (the SDK's uploads do). So a declared body up to ``drain_bytes`` past the
    limit is read and discarded first; a larger one is refused at once and
    the connection closed."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, drain_bytes: int = 8 * 1024 * 1024) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    drain = declared <= self.max_bytes + self.drain_bytes
                    if drain:
                        await _drain(receive)
                    await _send_too_large(send, close=not drain)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestTooLarge:
            # Normally the exception handlers answer; this covers a body read
            # outside them.
            if not started:
                await _send_too_large(send, close=True)


class MetricsMiddleware:
    """Counts requests and observes latency by method, route template and status."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            # Unmatched paths share one label so scanners cannot blow up cardinality.
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            HTTP_REQUESTS.labels(method=method, route=template, status=str(status)).inc()
            HTTP_LATENCY.labels(method=method, route=template).observe(time.perf_counter() - started)


class RequestIdMiddleware:
    """Gives every request an ID (the caller's ``X-Request-ID`` or a new one),
    binds it for logs, forwards it to the services (the gRPC client
    interceptor sends ``request_id_var``) and returns it as ``x-request-id``,
    which the SDK exposes as ``error.request_id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                request_id = value.decode("latin-1").strip()[:_MAX_REQUEST_ID_LEN]
        request_id = request_id or f"req_{uuid.uuid4().hex}"
        request_id_var.set(request_id)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
