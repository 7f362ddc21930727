"""Server and client interceptors.

Server side: bind request context (org, request ID, method, and the session,
environment, turn and sandbox IDs a request names) into structlog
contextvars, count requests and their latency by method and status code,
require an organization on every Berth RPC, and map domain errors
to rich gRPC statuses in one place; an unknown exception becomes INTERNAL with
its traceback logged. Client side: propagate the organization and put a
deadline on every call that has none.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_status import rpc_status

from services.core.context import ORG_METADATA_KEY, REQUEST_ID_METADATA_KEY, org_id_var, request_id_var
from services.core.errors import BerthError, from_rpc_error, to_rpc_status
from services.core.logging import get_logger
from services.core.metrics import RPC_LATENCY, RPC_REQUESTS

__all__ = ["ServerContextInterceptor", "ClientContextInterceptors"]

log = get_logger("berth.rpc")

_UNAUTHENTICATED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
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


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


async def _abort(context: grpc.aio.ServicerContext, error: BerthError) -> None:
    status = rpc_status.to_status(to_rpc_status(error))
    metadata = tuple(status.trailing_metadata)
    if error.grpc_code == grpc.StatusCode.UNAVAILABLE:
        # A domain UNAVAILABLE (e.g. the sandbox is unreachable) comes from a
        # server that did answer: the caller's transport retries must not
        # multiply it through every hop.
        metadata += (("grpc-retry-pushback-ms", "-1"),)
    await context.abort_with_status(_Status(status.code, status.details, metadata))


class ServerContextInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNAUTHENTICATED_PREFIXES):
            return handler
        org = ""
        request_id = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == ORG_METADATA_KEY:
                org = value if isinstance(value, str) else value.decode()
            elif key == REQUEST_ID_METADATA_KEY:
                request_id = value if isinstance(value, str) else value.decode()

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
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def details(self, client_call_details: grpc.aio.ClientCallDetails, *, streaming: bool) -> grpc.aio.ClientCallDetails:
        org = org_id_var.get()
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
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


def ClientContextInterceptors(timeout_s: float) -> list[grpc.aio.ClientInterceptor]:  # noqa: N802
    return [_UnaryUnary(timeout_s), _UnaryStream(timeout_s)]
