"""Server and client interceptors.

Server side: authenticate every call but health checks (the internal token,
compared in constant time) and let only the peers a method's table names call
it; then, and only then, bind request context (org, request ID, method, and
the session, environment, turn and sandbox IDs a request names) into
structlog contextvars, count requests and their latency by method and status
code, require an organization on every Berth RPC, and map domain errors to
rich gRPC statuses in one place; an unknown exception becomes INTERNAL with
its traceback logged. Client side: attach the peer's credentials, propagate
the organization and put a deadline on every call that has none.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
import structlog
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from services.core.context import (
    ORG_METADATA_KEY,
    PEER_METADATA_KEY,
    PEERS,
    REQUEST_ID_METADATA_KEY,
    TOKEN_METADATA_KEY,
    Peer,
    PeerCredentials,
    org_id_var,
    request_id_var,
)
from services.core.errors import BerthError, PeerNotAllowed, PeerUnauthenticated, from_rpc_error, to_rpc_status
from services.core.logging import get_logger
from services.core.metrics import RPC_LATENCY, RPC_REQUESTS

__all__ = ["ServerContextInterceptor", "ClientContextInterceptors", "CallerTable", "allowed_callers", "undeclared_methods"]

log = get_logger("berth.rpc")

# Health stays open so orchestrators' gRPC probes work without the secret.
_OPEN_PREFIXES = ("/grpc.health.",)
# Reflection answers any authenticated peer and names no organization.
_ANY_PEER_PREFIXES = ("/grpc.reflection.",)
_STREAM_DEADLINE_S = 24 * 3600.0


# Request fields bound into the log context of the RPC, so every line a
# handler logs names the resources it works on.
_CONTEXT_FIELDS = ("session_id", "environment_id", "turn_id", "sandbox_id")


@functools.cache
def _context_fields(descriptor: Any) -> tuple[str, ...]:
    return tuple(name for name in _CONTEXT_FIELDS if name in descriptor.fields_by_name)


def _request_ids(request: Any) -> dict[str, str]:
    descriptor = getattr(request, "DESCRIPTOR", None)
    if descriptor is None:
        return {}
    ids: dict[str, str] = {}
    for name in _context_fields(descriptor):
        value = getattr(request, name)
        if value and isinstance(value, str):
            ids[name] = value
    return ids


CallerTable = Mapping[str, frozenset[str]]
"""Full method name (``/package.Service/Method``) -> the peers that may call it."""


def allowed_callers(service: Any, callers: Mapping[Peer, Iterable[str]]) -> dict[str, frozenset[str]]:
    """The caller table of ``service`` (a ServiceDescriptor) from peer -> the
    method names it may call. A name that is not a method of the service is
    a mistake and fails at import."""
    methods = {method.name for method in service.methods}
    table: dict[str, set[str]] = {}
    for peer, names in callers.items():
        for name in names:
            if name not in methods:
                raise ValueError(f"{service.full_name} has no method {name}")
            table.setdefault(f"/{service.full_name}/{name}", set()).add(peer)
    return {method: frozenset(peers) for method, peers in table.items()}


def undeclared_methods(services: Iterable[Any], callers: CallerTable) -> list[str]:
    """Methods of ``services`` (ServiceDescriptors) that no peer may call:
    a new RPC must name its callers before a server will serve it."""
    return [
        f"/{service.full_name}/{method.name}"
        for service in services
        for method in service.methods
        if not callers.get(f"/{service.full_name}/{method.name}")
    ]


def _metadata(invocation_metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    values: dict[str, str] = {}
    for key, value in invocation_metadata or ():
        values.setdefault(key, value if isinstance(value, str) else value.decode(errors="replace"))
    return values


def _refusing(handler: grpc.RpcMethodHandler, error: BerthError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only aborts with ``error``."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await _abort(context, error)

    kinds: tuple[tuple[Any, Callable[..., grpc.RpcMethodHandler]], ...] = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    )
    build = next(build for behaviour, build in kinds if behaviour is not None)
    return build(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


# An error travels in trailing metadata (grpc-message, and again in
# grpc-status-details-bin with its ErrorInfo), which peers cap at 8 KiB by
# default: a message that quotes a long input must not outgrow it and turn
# a clean INVALID_ARGUMENT into a transport failure.
# Bounds in UTF-8 bytes: grpc-message percent-encodes each non-ASCII byte.
_MAX_MESSAGE_BYTES = 1024
_MAX_METADATA_VALUE_BYTES = 256


def _clip(text: str, limit: int) -> str:
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", "ignore") + "\u2026"


def _bounded(status: status_pb2.Status) -> status_pb2.Status:
    """``status`` with its message and ErrorInfo metadata clipped."""
    status.message = _clip(status.message, _MAX_MESSAGE_BYTES)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            for key, value in info.metadata.items():
                info.metadata[key] = _clip(value, _MAX_METADATA_VALUE_BYTES)
            detail.Pack(info)
    return status


async def _abort(context: grpc.aio.ServicerContext, error: BerthError) -> None:
    status = rpc_status.to_status(_bounded(to_rpc_status(error)))
    metadata = tuple(status.trailing_metadata)
    if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
        # A domain UNAVAILABLE (e.g. the sandbox is unreachable) comes from a
        # server that did answer: the caller's transport retries must not
        # multiply it through every hop.
        metadata += (("grpc-retry-pushback-ms", "-1"),)
    await context.abort_with_status(_Status(status.code, status.details, metadata))


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, *, token: str, callers: CallerTable) -> None:
        if not token:
            raise ValueError("a server needs the internal token")
        self._token = token.encode()
        self._callers = callers

    def _refusal(self, method: str, metadata: Mapping[str, str]) -> BerthError | None:
        token = metadata.get(TOKEN_METADATA_KEY, "").encode()
        peer = metadata.get(PEER_METADATA_KEY, "")
        if not peer or not hmac.compare_digest(token, self._token):
            return PeerUnauthenticated("missing or invalid internal credentials")
        allowed = PEERS if method.startswith(_ANY_PEER_PREFIXES) else self._callers.get(method, frozenset())
        if peer not in allowed:
            return PeerNotAllowed(f"peer {peer[:64]!r} may not call {method}")
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = _metadata(handler_call_details.invocation_metadata)
        refusal = self._refusal(method, metadata)
        if refusal is not None:
            RPC_REQUESTS.labels(method=method, code=refusal.grpc_code.name).inc()
            log.warning("rpc_refused", rpc=method, code=refusal.grpc_code.name, peer=metadata.get(PEER_METADATA_KEY, "")[:64])
            return _refusing(handler, refusal)
        if method.startswith(_ANY_PEER_PREFIXES):
            return handler
        # Read only now: an organization counts only from an authenticated peer.
        org = metadata.get(ORG_METADATA_KEY, "")
        request_id = metadata.get(REQUEST_ID_METADATA_KEY, "")

        def bind(request: Any) -> float:
            org_id_var.set(org)
            request_id_var.set(request_id)
            structlog.contextvars.clear_contextvars()
            structlog.contextvars.bind_contextvars(
                org_id=org, rpc=method, request_id=request_id or None, **_request_ids(request)
            )
            return time.perf_counter()

        def record(code: str, started: float) -> None:
            RPC_REQUESTS.labels(method=method, code=code).inc()
            RPC_LATENCY.labels(method=method, code=code).observe(time.perf_counter() - started)

        async def fail(context: grpc.aio.ServicerContext, exc: BaseException, started: float) -> None:
            if isinstance(exc, grpc.RpcError) and not isinstance(exc, grpc.aio.AbortError):
                exc = from_rpc_error(exc)
            if isinstance(exc, BerthError):
                record(exc.grpc_code.name, started)
                if exc.grpc_code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
                    log.warning("rpc_failed", code=exc.grpc_code.name, reason=exc.reason, error=exc.message)
                await _abort(context, exc)
            log.exception("rpc_internal_error", exc_info=exc)
            record("INTERNAL", started)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")

        def missing_org() -> BerthError:
            from services.core.errors import Unauthenticated

            return Unauthenticated("missing organization metadata")

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started = bind(request)
                if not org:
                    await _abort(context, missing_org())
                try:
                    response = await inner_uu(request, context)
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:
                    record("CANCELLED", started)
                    raise
                except Exception as exc:  # the one place errors become statuses
                    await fail(context, exc, started)
                    raise
                record("OK", started)
                return response

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started = bind(request)
                if not org:
                    await _abort(context, missing_org())
                try:
                    async for response in inner_us(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:
                    record("CANCELLED", started)
                    raise
                except Exception as exc:
                    await fail(context, exc, started)
                    raise
                record("OK", started)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


class _Deadline:
    def __init__(self, timeout_s: float, credentials: PeerCredentials | None) -> None:
        self.timeout_s = timeout_s
        self.credentials = credentials

    def details(self, client_call_details: grpc.aio.ClientCallDetails, *, streaming: bool) -> grpc.aio.ClientCallDetails:
        org = org_id_var.get()
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
        if self.credentials is not None:
            for key, value in self.credentials.metadata():
                if key not in metadata:
                    metadata.add(key, value)
        if org and ORG_METADATA_KEY not in metadata:
            metadata.add(ORG_METADATA_KEY, org)
        rid = request_id_var.get()
        if rid and REQUEST_ID_METADATA_KEY not in metadata:
            metadata.add(REQUEST_ID_METADATA_KEY, rid)
        timeout = client_call_details.timeout
        if timeout is None:
            # Streams (exec, event follow) are long-lived; they still get a
            # deadline, just a far one, and callers pass tighter ones.
            timeout = _STREAM_DEADLINE_S if streaming else self.timeout_s
        return grpc.aio.ClientCallDetails(
            method=client_call_details.method,
            timeout=timeout,
            metadata=metadata,
            credentials=client_call_details.credentials,
            wait_for_ready=client_call_details.wait_for_ready,
        )


class _UnaryUnary(_Deadline, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self.details(client_call_details, streaming=False), request)


class _UnaryStream(_Deadline, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self.details(client_call_details, streaming=True), request)


def ClientContextInterceptors(  # noqa: N802
    timeout_s: float, credentials: PeerCredentials | None
) -> list[grpc.aio.ClientInterceptor]:
    """``credentials`` None sends none: only the open health service answers."""
    return [_UnaryUnary(timeout_s, credentials), _UnaryStream(timeout_s, credentials)]
