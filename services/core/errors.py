"""The domain error hierarchy.

Each error carries its gRPC status code and an ``ErrorInfo`` reason. One server
interceptor turns them into rich gRPC statuses; the gateway turns those into
HTTP statuses and OpenAI error codes with one table.
"""

from __future__ import annotations

from typing import ClassVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

__all__ = [
    "BerthError",
    "NotFound",
    "InvalidArgument",
    "FailedPrecondition",
    "EnvironmentInUse",
    "InitializationRunning",
    "SessionActive",
    "SpendLimitReached",
    "TraceTooLarge",
    "EnvironmentFailed",
    "McpServerDead",
    "OAuthRefreshFailed",
    "Conflict",
    "Unavailable",
    "SandboxUnavailable",
    "DatabaseUnavailable",
    "PermissionDenied",
    "Unauthenticated",
    "PeerUnauthenticated",
    "PeerNotAllowed",
    "ERROR_DOMAIN",
    "to_rpc_status",
    "reason_from_rpc_error",
]

ERROR_DOMAIN = "berth.dev"


# Every error class of this module by its ErrorInfo reason: filled as the
# classes are declared, so a reason's only home is its class. The server
# interceptor sends ``reason``; the client interceptor looks the class up
# here. Subclasses declared elsewhere cross a hop as their base class.
_BY_REASON: dict[str, type[BerthError]] = {}


class BerthError(Exception):
    """Base of all domain errors."""

    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, param: str | None = None, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.metadata = dict(metadata)
        if param is not None:
            self.metadata.setdefault("param", param)
        # The status a downstream call ended with, for errors rebuilt from one
        # (see from_rpc_error); None for errors raised in this process.
        self.received_code: grpc.StatusCode | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "reason" in cls.__dict__ and cls.__module__ == __name__:
            if cls.reason in _BY_REASON:
                raise TypeError(f"reason {cls.reason} belongs to {_BY_REASON[cls.reason].__name__} already")
            _BY_REASON[cls.reason] = cls


class NotFound(BerthError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class InvalidArgument(BerthError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "VALIDATION_ERROR"


class PathOutsideWorkspace(InvalidArgument):
    reason = "PATH_OUTSIDE_WORKSPACE"


class FailedPrecondition(BerthError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class EnvironmentInUse(FailedPrecondition):
    reason = "ENVIRONMENT_IN_USE"


class InitializationRunning(FailedPrecondition):
    reason = "INITIALIZATION_RUNNING"


class SessionActive(FailedPrecondition):
    reason = "SESSION_ACTIVE"


class SpendLimitReached(FailedPrecondition):
    """The session's spend reached its ``spend_control.limit``."""

    reason = "SPEND_LIMIT_REACHED"


class TraceTooLarge(FailedPrecondition):
    """A trace that does not fit in a response page by itself."""

    reason = "TRACE_TOO_LARGE"


class EnvironmentFailed(FailedPrecondition):
    reason = "ENVIRONMENT_FAILED"


class McpServerDead(FailedPrecondition):
    """An environment-origin MCP broker's server has died; it is not
    restarted with a later configuration."""

    reason = "MCP_SERVER_DEAD"


class OAuthRefreshFailed(FailedPrecondition):
    """A vault credential's access token expired and its OAuth refresh
    failed: the token endpoint refused, was unreachable or not allowed, or
    answered something other than a token. The message never quotes a
    secret or the endpoint's own error text."""

    reason = "OAUTH_REFRESH_FAILED"


class Conflict(BerthError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    reason = "CONFLICT"


class Unavailable(BerthError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class SandboxUnavailable(Unavailable):
    reason = "SANDBOX_UNAVAILABLE"


class DatabaseUnavailable(Unavailable):
    """The service's database could not serve a unit of work for a reason
    that passes (a lost or refused connection, a server restarting, every
    pooled connection busy, SQLite's lock held past its timeout). Raised by
    ``Database`` (services/core/db.py); the message never quotes the
    database's own error, which the service logs."""

    reason = "DATABASE_UNAVAILABLE"


class PermissionDenied(BerthError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    reason = "INSUFFICIENT_SCOPES"


class Unauthenticated(BerthError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PeerUnauthenticated(Unauthenticated):
    """An internal call without the deployment's internal token: a
    misconfigured Berth process, or not a Berth process at all."""

    reason = "PEER_UNAUTHENTICATED"


class PeerNotAllowed(PermissionDenied):
    """An authenticated Berth peer called an RPC its role does not need."""

    reason = "PEER_NOT_ALLOWED"


def to_rpc_status(error: BerthError) -> status_pb2.Status:
    """Builds the google.rpc.Status for ``error`` with its ErrorInfo detail."""
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=error.grpc_code.value[0], message=error.message, details=[detail])


def reason_from_rpc_error(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """Extracts the ErrorInfo reason and metadata from a failed call, if any."""
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(exc)
    except Exception:  # a malformed trailer must not hide the original error
        return "", {}
    if status is None:
        return "", {}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason, dict(info.metadata)
    return "", {}


_REFUSED_PEER = frozenset({PeerUnauthenticated.reason, PeerNotAllowed.reason})

_BY_CODE: dict[grpc.StatusCode, type[BerthError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def from_rpc_error(exc: grpc.RpcError) -> BerthError:
    """Rebuilds the domain error a downstream service raised, so it passes
    through a hop with its reason intact. Unknown failures become Unavailable
    when the peer could not be reached and BerthError (INTERNAL) otherwise."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    reason, metadata = reason_from_rpc_error(exc)
    if reason in _REFUSED_PEER:
        # The refused hop is this process, not the end user: passed on as
        # UNAUTHENTICATED it would read as the user's API key being wrong.
        return BerthError(f"internal call refused ({reason}): {details}")
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, BerthError)
    param = metadata.pop("param", None)
    error = cls(details or code.name, param=param, **metadata)
    error.received_code = code
    return error


__all__ += ["PathOutsideWorkspace", "from_rpc_error"]
