"""The client side of a Berth service-to-service call.

``DomainErrorInterceptors`` mirror the server interceptor: a failed call
comes back as the domain error (``services.core.errors``) its ErrorInfo
reason names, so no caller reads gRPC status codes. ``service_config``
builds a channel's retry policy from the ``idempotency_level`` each method
declares in its proto: only those methods are retried, and only on
UNAVAILABLE. ``call_until_available`` is the longer wait above it: a
dependency that is down or restarting is called again, with backoff, for a
bounded time, with hooks that tell the caller's users it is waiting.
``ReadyWaitInterceptors`` hold a call until its channel is connected, for a
bounded time, so a call to a restarting service waits for it instead of
failing at once; a call that finds no connection in that time fails with
``PeerUnreachable``, which proves it was never sent.
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
    "PeerUnreachable",
    "ReadyWaitInterceptors",
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


class PeerUnreachable(grpc.aio.AioRpcError):
    """UNAVAILABLE raised before a call was sent: its channel found no
    connection to the service within the wait. Unlike UNAVAILABLE in
    general (a connection can break after the service has acted), this one
    proves the service never saw the request."""

    def __init__(self, target: str, waited_s: float) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details=f"{target} did not accept a connection within {waited_s:g} s",
        )


class _ReadyWait:
    """Holds each call until the channel is READY, at most ``wait_s``; then
    sends it with ``wait_for_ready`` so a connection lost between the check
    and the send is waited for too (under the call's own deadline). A call
    that sets ``wait_for_ready=False`` itself (a health probe) is sent at
    once. ``channel`` is set by whoever opens the channel."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.channel: grpc.aio.Channel | None = None
        self.target = "the service"

    async def ready(self, client_call_details: Any) -> Any:
        if client_call_details.wait_for_ready is False or self.channel is None:
            return client_call_details
        if self.channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
            try:
                async with asyncio.timeout(self.wait_s):
                    await self.channel.channel_ready()
            except TimeoutError:
                raise PeerUnreachable(self.target, self.wait_s) from None
        return grpc.aio.ClientCallDetails(
            method=client_call_details.method,
            timeout=client_call_details.timeout,
            metadata=client_call_details.metadata,
            credentials=client_call_details.credentials,
            wait_for_ready=True,
        )


class _ReadyWaitUnaryUnary(_ReadyWait, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(await self.ready(client_call_details), request)


class _ReadyWaitUnaryStream(_ReadyWait, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(await self.ready(client_call_details), request)


def ReadyWaitInterceptors(wait_s: float) -> list[_ReadyWait]:  # noqa: N802
    """Interceptors that wait for a connection before each call (see
    ``_ReadyWait``); give each the channel once it is open."""
    return [_ReadyWaitUnaryUnary(wait_s), _ReadyWaitUnaryStream(wait_s)]


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
