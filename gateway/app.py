"""Composition root of the public REST gateway.

``create_app`` builds the FastAPI app; its lifespan opens the gateway's own
database and the gRPC channels to the Session and Environment services, and
closes them at shutdown. ``start_gateway`` runs that app on uvicorn inside
the current event loop (``berth serve`` and the tests use it; port 0 picks
a free port).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from berth.environment.v1 import (
    environment_service_pb2,
    environment_service_pb2_grpc,
    vault_service_pb2,
    vault_service_pb2_grpc,
)
from berth.session.v1 import (
    automation_service_pb2,
    automation_service_pb2_grpc,
    session_service_pb2,
    session_service_pb2_grpc,
    webhook_service_pb2,
    webhook_service_pb2_grpc,
)
from gateway.errors import install_error_handlers
from gateway.keys import open_gateway_database
from gateway.middleware import BodyLimitMiddleware, MetricsMiddleware, RequestIdMiddleware
from gateway.routes import (
    agents,
    automations,
    environment_templates,
    environments,
    files,
    ops,
    session_resources,
    sessions,
    subagents,
    vaults,
    webhooks,
)
from gateway.idempotency import AttemptInterceptor
from gateway.state import GatewayState
from services.core.context import PeerCredentials
from services.core.db import Database
from services.core.grpc_client import retried_methods
from services.core.grpc_server import open_channel
from services.core.logging import get_logger
from services.core.settings import Settings

__all__ = ["create_app", "start_gateway", "GatewayHandle"]

log = get_logger("berth.gateway")

_SESSION_SERVICE = session_service_pb2.DESCRIPTOR.services_by_name["SessionService"]
_WEBHOOK_SERVICE = webhook_service_pb2.DESCRIPTOR.services_by_name["WebhookService"]
_AUTOMATION_SERVICE = automation_service_pb2.DESCRIPTOR.services_by_name["AutomationService"]
_ENVIRONMENT_SERVICE = environment_service_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]
_VAULT_SERVICE = vault_service_pb2.DESCRIPTOR.services_by_name["VaultService"]
_HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"]


def create_app(settings: Settings, *, session_addr: str | None = None, environment_addr: str | None = None) -> FastAPI:
    """The gateway app. ``*_addr`` override the upstream addresses in ``settings``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            credentials = PeerCredentials.from_settings(settings, "gateway")
            db = await open_gateway_database(settings)
            session_services = [_SESSION_SERVICE, _WEBHOOK_SERVICE, _AUTOMATION_SERVICE, _HEALTH_SERVICE]
            environment_services = [_ENVIRONMENT_SERVICE, _VAULT_SERVICE, _HEALTH_SERVICE]
            session_channel = open_channel(
                session_addr or settings.session_addr,
                timeout_s=settings.rpc_timeout_s,
                credentials=credentials,
                services=session_services,
                ready_wait_s=settings.gateway_upstream_wait_s,
                interceptors=[AttemptInterceptor(retried_methods(session_services))],
            )
            environment_channel = open_channel(
                environment_addr or settings.environment_addr,
                timeout_s=settings.rpc_timeout_s,
                credentials=credentials,
                services=environment_services,
                ready_wait_s=settings.gateway_upstream_wait_s,
                interceptors=[AttemptInterceptor(retried_methods(environment_services))],
            )
        except BaseException as exc:
            app.state.startup_error = exc
            raise
        state = GatewayState(
            settings=settings,
            db=db,
            session=session_service_pb2_grpc.SessionServiceStub(session_channel),
            environment=environment_service_pb2_grpc.EnvironmentServiceStub(environment_channel),
            vaults=vault_service_pb2_grpc.VaultServiceStub(environment_channel),
            automations=automation_service_pb2_grpc.AutomationServiceStub(session_channel),
            session_health=health_pb2_grpc.HealthStub(session_channel),
            webhooks=webhook_service_pb2_grpc.WebhookServiceStub(session_channel),
            environment_health=health_pb2_grpc.HealthStub(environment_channel),
            channels=[session_channel, environment_channel],
        )
        app.state.berth = state
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="Berth", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.startup_error = None
    install_error_handlers(app)

    # Literal segments (automations, environments, sessions) before /agents/{agent_id},
    # and environments/templates before /agents/environments/{environment_id}.
    for module in (
        automations,
        environment_templates,
        environments,
        sessions,
        session_resources,
        subagents,
        files,
        agents,
        vaults,
        webhooks,
        ops,
    ):
        app.include_router(module.router)

    # The last added middleware is the outermost: metrics see every response,
    # including the 413s of the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(MetricsMiddleware)
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: in-process the owner (``berth
    serve``, ``python -m gateway``, tests) decides when to stop."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = asyncio.Event()

    def capture_signals(self) -> Any:
        return nullcontext()

    async def startup(self, sockets: Any = None) -> None:
        try:
            await super().startup(sockets=sockets)
        except SystemExit:
            # uvicorn exits the process when the lifespan fails; embedded, the
            # caller of start_gateway gets an exception instead.
            self.should_exit = True
        finally:
            self.startup_done.set()


@dataclass
class GatewayHandle:
    """A running gateway."""

    app: FastAPI
    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def base_url(self) -> str:
        """A dialable URL (a wildcard bind address is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def database(self) -> Database:
        """The gateway's own database (organizations, keys), for the CLI and tests."""
        state = self.app.state.berth
        assert isinstance(state, GatewayState)
        return state.db

    async def stop(self) -> None:
        """Ends open event streams, stops accepting, lets in-flight requests
        finish (up to the grace period), then runs the lifespan shutdown."""
        state = getattr(self.app.state, "berth", None)
        if isinstance(state, GatewayState):
            state.closing.set()
        self.server.should_exit = True
        await self.task


async def start_gateway(
    settings: Settings,
    *,
    port: int | None = None,
    host: str | None = None,
    session_addr: str | None = None,
    environment_addr: str | None = None,
) -> GatewayHandle:
    """Starts the gateway in this event loop and returns once it accepts
    connections. ``port=0`` binds a free port (see ``handle.port``). Without
    an internal token it raises ``InternalTokenMissing`` before it binds."""
    PeerCredentials.from_settings(settings, "gateway")
    app = create_app(settings, session_addr=session_addr, environment_addr=environment_addr)
    bind_host = host if host is not None else settings.gateway_host
    config = uvicorn.Config(
        app,
        host=bind_host,
        port=settings.gateway_port if port is None else port,
        lifespan="on",
        log_config=None,
        access_log=False,
        ws="none",
        # A declared dependency: never a silent fall back to the pure-Python h11.
        http="httptools",
        timeout_graceful_shutdown=max(int(settings.grace_s), 1),
    )
    server = _EmbeddedServer(config)
    # Bound here rather than by uvicorn, which calls sys.exit() when a bind
    # fails; an OSError is what an embedding process can handle.
    sock = _bind(bind_host, config.port)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="berth-gateway")
    startup = asyncio.ensure_future(server.startup_done.wait())
    await asyncio.wait({task, startup}, return_when=asyncio.FIRST_COMPLETED)
    startup.cancel()
    if not server.started:
        # The lifespan failed; uvicorn has logged why.
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)
        sock.close()
        raise RuntimeError("gateway failed to start") from app.state.startup_error
    bound = int(server.servers[0].sockets[0].getsockname()[1])
    log.info("gateway_started", host=bind_host, port=bound)
    return GatewayHandle(app=app, server=server, task=task, host=bind_host, port=bound)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
