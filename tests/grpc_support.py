"""Authenticated gRPC channels for tests that drive Berth's services directly.

tests/conftest.py puts ``TEST_INTERNAL_TOKEN`` in ``BERTH_INTERNAL_TOKEN``,
so every ``Settings()`` the suite builds, and every service process it
spawns, expects it. Test modules import from here (``from grpc_support
import internal_channel``)."""

from __future__ import annotations

import functools
from typing import Any

import grpc

from services.core.context import PEER_METADATA_KEY, Peer, PeerCredentials
from services.core.interceptors import CallerTable, ClientContextInterceptors

__all__ = ["TEST_INTERNAL_TOKEN", "internal_channel", "credentials"]

TEST_INTERNAL_TOKEN = "berth-test-internal-token"


@functools.cache
def _callers() -> CallerTable:
    # Imported on first use: tests/conftest.py imports this module early.
    from services.environment.server import ENVIRONMENT_CALLERS, VAULT_CALLERS
    from services.sandbox.server import SANDBOX_CALLERS
    from services.session.server import SESSION_CALLERS

    return {**SESSION_CALLERS, **ENVIRONMENT_CALLERS, **VAULT_CALLERS, **SANDBOX_CALLERS}


def credentials(peer: Peer) -> PeerCredentials:
    return PeerCredentials(peer, TEST_INTERNAL_TOKEN)


class _AllowedPeer:
    """Names, for each call, a peer its method's caller table allows."""

    def details(self, client_call_details: Any) -> grpc.aio.ClientCallDetails:
        method = client_call_details.method
        allowed = _callers().get(method.decode() if isinstance(method, bytes) else method)
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
        if allowed and PEER_METADATA_KEY not in metadata:
            metadata.add(PEER_METADATA_KEY, min(allowed))
        return grpc.aio.ClientCallDetails(
            method=method,
            timeout=client_call_details.timeout,
            metadata=metadata,
            credentials=client_call_details.credentials,
            wait_for_ready=client_call_details.wait_for_ready,
        )


class _UnaryUnary(_AllowedPeer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self.details(client_call_details), request)


class _UnaryStream(_AllowedPeer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self.details(client_call_details), request)


def internal_channel(address: str, *, peer: Peer | None = None, timeout_s: float = 300.0) -> grpc.aio.Channel:
    """A channel that carries the suite's internal token. Calls name ``peer``,
    or by default a peer their method allows, so one stub can drive RPCs
    that the gateway and the Session service each call in production."""
    pickers: list[grpc.aio.ClientInterceptor] = [] if peer is not None else [_UnaryUnary(), _UnaryStream()]
    return grpc.aio.insecure_channel(
        address, interceptors=[*pickers, *ClientContextInterceptors(timeout_s, credentials(peer or "cli"))]
    )
