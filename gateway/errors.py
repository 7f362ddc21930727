"""The OpenAI error envelope and the one table from gRPC failures to HTTP.

Every error the gateway returns, including unknown routes, wrong methods,
request validation, oversized and malformed bodies, is
``{"error": {"message", "type", "param", "code"}}``.

A downstream failure is looked up by (gRPC status code, ErrorInfo reason)
first and by status code alone second; anything unlisted is a 500
``internal_error`` whose details are logged, not returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.core.errors import BerthError, reason_from_rpc_error
from services.core.logging import get_logger

__all__ = [
    "ApiError",
    "HttpError",
    "GRPC_ERROR_TABLE",
    "map_rpc_error",
    "error_body",
    "error_response",
    "internal_error",
    "install_error_handlers",
    "RequestTooLarge",
    "param_from_loc",
]

log = get_logger("berth.gateway.errors")

INVALID_REQUEST = "invalid_request_error"


@dataclass(frozen=True)
class HttpError:
    """How one class of failure looks on the wire."""

    status: int
    type: str
    code: str
    # False tells the SDK not to retry a 409 that cannot resolve by itself
    # (it retries 408/409/429/5xx by default).
    retryable: bool | None = None


class ApiError(Exception):
    """An error raised by the gateway itself."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type
        self.retryable = retryable


class RequestTooLarge(StarletteHTTPException):
    """Raised while a body is being received, once it exceeds the limit."""

    def __init__(self) -> None:
        super().__init__(status_code=413, detail="request body too large")


_NOT_FOUND = HttpError(404, INVALID_REQUEST, "not_found")
_VALIDATION = HttpError(400, INVALID_REQUEST, "validation_error")
_INTERNAL = HttpError(500, "server_error", "internal_error")

# (gRPC status, ErrorInfo reason or "" for any reason) -> wire error.
GRPC_ERROR_TABLE: Mapping[tuple[grpc.StatusCode, str], HttpError] = {
    # The gateway's own internal credentials were refused: Berth is
    # misconfigured, the caller's key is not at fault.
    (grpc.StatusCode.UNAUTHENTICATED, "PEER_UNAUTHENTICATED"): _INTERNAL,
    (grpc.StatusCode.PERMISSION_DENIED, "PEER_NOT_ALLOWED"): _INTERNAL,
    (grpc.StatusCode.UNAUTHENTICATED, ""): HttpError(401, "authentication_error", "invalid_api_key"),
    (grpc.StatusCode.PERMISSION_DENIED, ""): HttpError(403, "permission_error", "insufficient_scopes"),
    (grpc.StatusCode.NOT_FOUND, ""): _NOT_FOUND,
    # The SDK's tool dispatcher retries this one (the call may not be registered yet).
    (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_TOOL_CALL"): HttpError(400, INVALID_REQUEST, INVALID_REQUEST),
    (grpc.StatusCode.INVALID_ARGUMENT, ""): _VALIDATION,
    (grpc.StatusCode.OUT_OF_RANGE, ""): _VALIDATION,
    (grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_IN_USE"): HttpError(
        409, INVALID_REQUEST, "environment_in_use", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "INITIALIZATION_RUNNING"): HttpError(
        409, INVALID_REQUEST, "environment_initializing"
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ACTIVE"): HttpError(
        409, INVALID_REQUEST, "session_in_progress", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "SPEND_LIMIT_REACHED"): HttpError(
        409, INVALID_REQUEST, "spend_limit_reached", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "TRACE_TOO_LARGE"): HttpError(
        400, INVALID_REQUEST, "trace_too_large", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_FAILED"): HttpError(
        409, INVALID_REQUEST, "environment_failed", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "MCP_SERVER_DEAD"): HttpError(
        409, INVALID_REQUEST, "mcp_server_dead", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, "OAUTH_REFRESH_FAILED"): HttpError(
        409, INVALID_REQUEST, "oauth_refresh_failed", retryable=False
    ),
    (grpc.StatusCode.FAILED_PRECONDITION, ""): HttpError(409, INVALID_REQUEST, "conflict", retryable=False),
    (grpc.StatusCode.ALREADY_EXISTS, ""): HttpError(409, INVALID_REQUEST, "conflict", retryable=False),
    (grpc.StatusCode.ABORTED, ""): HttpError(409, INVALID_REQUEST, "conflict"),
    (grpc.StatusCode.UNAVAILABLE, "SANDBOX_UNAVAILABLE"): HttpError(503, "server_error", "sandbox_unavailable"),
    (grpc.StatusCode.UNAVAILABLE, ""): HttpError(503, "server_error", "service_unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, ""): HttpError(504, "server_error", "timeout"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, ""): HttpError(429, "rate_limit_error", "rate_limit_exceeded"),
    (grpc.StatusCode.UNIMPLEMENTED, ""): HttpError(501, INVALID_REQUEST, "not_implemented", retryable=False),
}

_HTTP_STATUS_CODES: Mapping[int, HttpError] = {
    400: HttpError(400, INVALID_REQUEST, "invalid_request"),
    401: HttpError(401, "authentication_error", "invalid_api_key"),
    403: HttpError(403, "permission_error", "insufficient_scopes"),
    404: _NOT_FOUND,
    405: HttpError(405, INVALID_REQUEST, "method_not_allowed"),
    413: HttpError(413, INVALID_REQUEST, "request_too_large"),
    415: HttpError(415, INVALID_REQUEST, "unsupported_media_type"),
}

# Messages of these statuses come from the service and are meant for callers;
# for the rest (INTERNAL, UNKNOWN...) the details stay in the logs.
_PUBLIC_MESSAGES = frozenset(code for code, _ in GRPC_ERROR_TABLE)


def map_rpc_error(exc: grpc.RpcError) -> ApiError:
    """Translates a failed gRPC call with the table."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    reason, metadata = reason_from_rpc_error(exc)
    return _mapped(code, reason, details, metadata)


def map_domain_error(exc: BerthError) -> ApiError:
    """Translates a domain error the gateway raised itself (its own
    database unavailable, say) with the same table."""
    return _mapped(exc.grpc_code, exc.reason, exc.message, exc.metadata)


def _mapped(code: grpc.StatusCode, reason: str, details: str, metadata: Mapping[str, str]) -> ApiError:
    wire = GRPC_ERROR_TABLE.get((code, reason)) or GRPC_ERROR_TABLE.get((code, "")) or _INTERNAL
    if wire is _INTERNAL:
        log.error("upstream_internal_error", grpc_code=code.name, reason=reason, details=details)
    message = details if wire is not _INTERNAL and code in _PUBLIC_MESSAGES and details else _default_message(wire)
    return ApiError(
        wire.status, wire.code, message, param=metadata.get("param") or None, type=wire.type, retryable=wire.retryable
    )


def _default_message(wire: HttpError) -> str:
    return {
        "internal_error": "The server had an error while processing your request.",
        "not_found": "The requested resource was not found.",
        "sandbox_unavailable": "The sandbox is temporarily unreachable.",
        "service_unavailable": "The service is temporarily unavailable.",
        "timeout": "The request timed out.",
    }.get(wire.code, wire.code.replace("_", " "))


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: ApiError) -> JSONResponse:
    headers: dict[str, str] = {}
    if error.retryable is not None:
        headers["x-should-retry"] = "true" if error.retryable else "false"
    return JSONResponse(
        error_body(error.message, error.type, error.code, error.param), status_code=error.status, headers=headers
    )


def param_from_loc(loc: tuple[int | str, ...] | list[int | str]) -> str | None:
    """``("body", "environment", "files", 0, "path")`` -> ``environment.files.0.path``."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or None


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _rpc_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, grpc.RpcError)
    return error_response(map_rpc_error(exc))


async def _domain_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BerthError)
    return error_response(map_domain_error(exc))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    wire = _HTTP_STATUS_CODES.get(exc.status_code)
    if wire is None:
        wire = HttpError(exc.status_code, INVALID_REQUEST if exc.status_code < 500 else "server_error", "error")
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else wire.code.replace("_", " ")
    response = error_response(ApiError(wire.status, wire.code, message, type=wire.type))
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = param_from_loc(tuple(first.get("loc", ())))
    message = f"Invalid value for {param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid"))
    return error_response(ApiError(400, "validation_error", message, param=param))


def internal_error() -> ApiError:
    """What an unexpected failure looks like: no details leave the gateway."""
    return ApiError(500, "internal_error", _default_message(_INTERNAL), type="server_error")


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("gateway_unhandled_error", exc_info=exc)
    return error_response(internal_error())


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(grpc.RpcError, _rpc_error)
    app.add_exception_handler(BerthError, _domain_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
