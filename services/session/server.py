"""Composition root of the Session service."""

from __future__ import annotations

from pathlib import Path

import grpc

from berth.session.v1 import session_service_pb2, session_service_pb2_grpc
from services.core.context import PeerCredentials
from services.core.db import open_database
from services.core.grpc_server import start_grpc_server
from services.core.interceptors import allowed_callers
from services.core.notify import open_notifier
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.session.artifacts import BlobStore
from services.session.domain import SessionDomain
from services.session.environment_client import EnvironmentClient
from services.session.harness.models import ProviderRegistry
from services.session.mcp_connections import McpConnections
from services.session.runner import TurnRunner
from services.session.servicer import SessionServicer
from services.session.store import Store

__all__ = ["start_session_service", "SESSION_CALLERS"]

_MIGRATIONS = Path(__file__).parent / "migrations" / "versions"
_SERVICE = session_service_pb2.DESCRIPTOR.services_by_name["SessionService"]

# The Session service answers the gateway alone.
SESSION_CALLERS = allowed_callers(_SERVICE, {"gateway": [method.name for method in _SERVICE.methods]})


async def start_session_service(
    settings: Settings, *, address: str | None = None, environment_addr: str | None = None
) -> ServiceHandle:
    """Starts the Session service. ``address`` overrides ``settings.session_addr``
    (tests pass ``"127.0.0.1:0"``); ``environment_addr`` overrides the
    Environment service address the harness and session lifecycle call."""
    credentials = PeerCredentials.from_settings(settings, "session")
    db = await open_database(settings.database_url("session"), "session", _MIGRATIONS)
    # Replicas hear each other's commits through it (LISTEN/NOTIFY on PostgreSQL).
    notifier = open_notifier(
        db,
        channel="berth_session",
        safety_poll_s=settings.notify_safety_poll_s,
        listen=settings.notify_listen,
        sole_writer=settings.session_sole_writer,
    )
    await notifier.start()
    store = Store(db, notifier)
    env_client = EnvironmentClient(
        environment_addr or settings.environment_addr,
        credentials=credentials,
        timeout_s=settings.rpc_timeout_s,
        setup_timeout_s=settings.setup_timeout_s,
    )
    providers = ProviderRegistry(settings)
    blobs = BlobStore(settings.data_dir.resolve() / "artifacts")
    mcp = McpConnections(call_timeout_s=settings.mcp_call_timeout_s, connect_timeout_s=settings.mcp_connect_timeout_s)
    runner = TurnRunner(
        store,
        env_client,
        providers,
        blobs,
        mcp=mcp,
        lease_s=settings.turn_lease_s,
        dependency_retry_s=settings.dependency_retry_s,
    )
    domain = SessionDomain(store, env_client, runner, blobs, mcp=mcp)

    def register(server: grpc.aio.Server) -> list[str]:
        session_service_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(domain), server)
        return [_SERVICE.full_name]

    try:
        running = await start_grpc_server(
            address or settings.session_addr, register, token=credentials.token, callers=SESSION_CALLERS
        )
    except BaseException:
        await env_client.close()
        await notifier.close()
        await db.dispose()
        raise
    await runner.start()
    # Closed in reverse order: the runner finishes its turns while the MCP
    # connections, the database and the environment channel are still open.
    return ServiceHandle(
        name="session",
        grpc=running,
        closers=[db.dispose, notifier.close, env_client.close, mcp.close, providers.close, runner.close],
    )
