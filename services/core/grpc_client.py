"""The client side of a Berth service-to-service call.

``DomainErrorInterceptors`` mirror the server interceptor: a failed call
comes back as the domain error (``services.core.errors``) its ErrorInfo
reason names, so no caller reads gRPC status codes. ``service_config``
builds a channel's retry policy from the ``idempotency_level`` each method
declares in its proto: only those methods are retried, and only on
UNAVAILABLE. ``call_until_available`` is the longer wait above it: a
dependency that is down or restarting is called again, with backoff, for a
bounded time, with hooks that tell the caller's users it is waiting.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor, descriptor_pb2

from services.core.errors import Unavailable, from_rpc_error

__all__ = [
    "DomainErrorInterceptors",
    "service_config",
    "retried_methods",
    "RETRY_POLICY",
    "call_until_available",
    "peer_unavailable",
]

T = TypeVar("T")

# Retries only for UNAVAILABLE: the peer was not reached (a domain
# UNAVAILABLE carries retry pushback, so it is not multiplied per hop).
RETRY_POLICY: dict[str, Any] = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

# Methods of protos that are not ours to annotate, known to be reads.
_FOREIGN_READS = frozenset({("grpc.health.v1.Health", "Check")})

_UNKNOWN = descriptor_pb2.MethodOptions.IDEMPOTENCY_UNKNOWN


def retried_methods(services: Iterable[descriptor.ServiceDescriptor]) -> list[tuple[str, str]]:
    """(service, method) pairs of ``services`` that declare themselves
    idempotent or free of side effects, in declaration order."""
    return [
        (service.full_name, method.name)
        for service in services
        for method in service.methods
        if method.GetOptions().idempotency_level != _UNKNOWN or (service.full_name, method.name) in _FOREIGN_READS
    ]


def service_config(services: Iterable[descriptor.ServiceDescriptor]) -> str:
    """The gRPC service config (JSON) of a channel to ``services``: the
    retry policy on each method that may be retried, and none on the others."""
    names = [{"service": service, "method": method} for service, method in retried_methods(services)]
    if not names:
        return "{}"
    return json.dumps({"methodConfig": [{"name": names, "retryPolicy": RETRY_POLICY}]})


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        call = await continuation(client_call_details, request)
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from exc


async def _translated(call: Any) -> AsyncIterator[Any]:
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        # Returned as the call's response iterator; cancelling the call the
        # caller holds still cancels the RPC.
        return _translated(await continuation(client_call_details, request))


def DomainErrorInterceptors() -> list[grpc.aio.ClientInterceptor]:  # noqa: N802
    """Interceptors that raise a failed call's domain error instead of
    ``grpc.aio.AioRpcError``; put them first, so they see the final status."""
    return [_UnaryUnary(), _UnaryStream()]


def peer_unavailable(error: BaseException) -> bool:
    """Whether a failed call ended UNAVAILABLE: the service it reached, or one
    behind it, is down or restarting (not a deadline, not a refusal)."""
    return isinstance(error, Unavailable) and error.received_code == grpc.StatusCode.UNAVAILABLE


async def call_until_available(
    call: Callable[[], Awaitable[T]],
    *,
    within_s: float,
    on_disconnected: Callable[[Unavailable], Awaitable[None]] | None = None,
    on_connected: Callable[[], Awaitable[None]] | None = None,
    first_backoff_s: float = 0.2,
    max_backoff_s: float = 2.0,
) -> T:
    """Runs ``call``; while it fails UNAVAILABLE (``peer_unavailable``), runs
    it again with exponential backoff, until ``within_s`` after the first
    failure, then raises that last failure. Only for calls that are safe to
    repeat after such a failure. ``on_disconnected`` runs once, at the first
    failure, and ``on_connected`` once the service answers after one (even
with another error)."""
    deadline: float | None = None
    delay = first_backoff_s
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not isinstance(exc, Unavailable) or not peer_unavailable(exc):
                if deadline is not None and on_connected is not None:
                    # It answered, if only with an error.
                    await on_connected()
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + within_s
                if on_disconnected is not None and within_s > 0:
                    await on_disconnected(exc)
            if now >= deadline:
                raise
            await asyncio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, max_backoff_s)
            continue
        if deadline is not None and on_connected is not None:
            await on_connected()
        return result
