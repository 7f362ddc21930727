"""Composition root of the Session service."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
import time

import grpc

from berth.session.v1 import (
    automation_service_pb2,
    automation_service_pb2_grpc,
    session_service_pb2,
    session_service_pb2_grpc,
    webhook_service_pb2,
    webhook_service_pb2_grpc,
)
from services.core.context import PeerCredentials
from services.core.db import open_database
from services.core.grpc_server import start_grpc_server
from services.core.interceptors import allowed_callers
from services.core.notify import open_notifier
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.session.session_controls import PriceTable
from services.session.artifacts import BlobStore
from services.session.automation_scheduler import AutomationNotice, AutomationScheduler, SessionDelivery
from services.session.automation_servicer import AutomationServicer
from services.session.automations import Automations
from services.session.domain import SessionDomain
from services.session.environment_client import EnvironmentClient
from services.session.harness.context import ContextLimits
from services.session.harness.models import ProviderRegistry
from services.session.mcp_connections import McpConnections
from services.session.runner import TurnRunner
from services.session.servicer import SessionServicer
from services.session.store import Store
from services.session.webhook_servicer import WebhookServicer
from services.session.webhooks import capture
from services.session.webhooks.delivery import DeliveryConfig, WebhookDeliverer
from services.session.webhooks.destinations import DestinationPolicy
from services.session.webhooks.endpoints import WebhookEndpoints
from services.session.webhooks.signing import open_secret_box
from services.session.traces import TraceStore

__all__ = ["start_session_service", "SESSION_CALLERS"]

_MIGRATIONS = Path(__file__).parent / "migrations" / "versions"
_SERVICE = session_service_pb2.DESCRIPTOR.services_by_name["SessionService"]
_WEBHOOKS = webhook_service_pb2.DESCRIPTOR.services_by_name["WebhookService"]
_AUTOMATIONS = automation_service_pb2.DESCRIPTOR.services_by_name["AutomationService"]

# The Session service answers the gateway alone.
SESSION_CALLERS = {
    **allowed_callers(_SERVICE, {"gateway": [method.name for method in _SERVICE.methods]}),
    **allowed_callers(_WEBHOOKS, {"gateway": [method.name for method in _WEBHOOKS.methods]}),
    **allowed_callers(_AUTOMATIONS, {"gateway": [method.name for method in _AUTOMATIONS.methods]}),
}


async def start_session_service(
    settings: Settings,
    *,
    address: str | None = None,
    environment_addr: str | None = None,
    clock: Callable[[], float] = time.time,
    automation_notice: AutomationNotice | None = None,
) -> ServiceHandle:
    """Starts the Session service. ``address`` overrides ``settings.session_addr``
    (tests pass ``"127.0.0.1:0"``); ``environment_addr`` overrides the
    Environment service address the harness and session lifecycle call.
    ``clock`` is what the automation schedule reads (tests move it);
    ``automation_notice`` hears each automation invocation's outcome."""
    credentials = PeerCredentials.from_settings(settings, "session")
    db = await open_database(settings.database_url("session"), "session", _MIGRATIONS, pool=settings.database_pool())
    # Replicas hear each other's commits through it (LISTEN/NOTIFY on PostgreSQL).
    notifier = open_notifier(
        db,
        channel="berth_session",
        safety_poll_s=settings.notify_safety_poll_s,
        listen=settings.notify_listen,
        sole_writer=settings.session_sole_writer,
    )
    await notifier.start()
    # Every unit of work writes the webhook deliveries of its events in its own transaction.
    store = Store(db, notifier, before_commit=capture)
    secret_box = open_secret_box(settings)
    destinations = DestinationPolicy(settings.webhook_allow_destinations)
    deliverer = WebhookDeliverer(db, notifier, secret_box, destinations, DeliveryConfig.from_settings(settings))
    env_client = EnvironmentClient(
        environment_addr or settings.environment_addr,
        credentials=credentials,
        timeout_s=settings.rpc_timeout_s,
        setup_timeout_s=settings.setup_timeout_s,
    )
    providers = ProviderRegistry(settings)
    blobs = BlobStore(settings.data_dir.resolve() / "artifacts")
    mcp = McpConnections(call_timeout_s=settings.mcp_call_timeout_s, connect_timeout_s=settings.mcp_connect_timeout_s)
    automations = Automations(store, env_client, clock=clock)
    prices = PriceTable(settings.model_prices)
    traces = TraceStore(store, otlp_endpoint=settings.trace_otlp_endpoint, export_timeout_s=settings.rpc_timeout_s)
    runner = TurnRunner(
        store,
        env_client,
        providers,
        blobs,
        mcp=mcp,
        lease_s=settings.turn_lease_s,
        dependency_retry_s=settings.dependency_retry_s,
        automations=automations,
        prices=prices,
        traces=traces,
        limits=ContextLimits(
            windows=dict(settings.model_context_windows),
            default_window=settings.model_context_window,
            threshold=settings.compaction_threshold,
        ),
    )
    domain = SessionDomain(store, env_client, runner, blobs, mcp=mcp, traces=traces)
    scheduler = AutomationScheduler(
        store,
        SessionDelivery(domain.sessions, domain.input),
        clock=clock,
        poll_s=settings.automation_poll_s,
        lease_s=settings.automation_delivery_lease_s,
        notify=automation_notice,
    )
    automations.on_change = scheduler.kick

    def register(server: grpc.aio.Server) -> list[str]:
        session_service_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(domain), server)
        webhook_service_pb2_grpc.add_WebhookServiceServicer_to_server(
            WebhookServicer(WebhookEndpoints(store, secret_box, destinations)), server
        )
        automation_service_pb2_grpc.add_AutomationServiceServicer_to_server(AutomationServicer(automations), server)
        return [_SERVICE.full_name, _WEBHOOKS.full_name, _AUTOMATIONS.full_name]

    try:
        running = await start_grpc_server(
            address or settings.session_addr, register, token=credentials.token, callers=SESSION_CALLERS
        )
    except BaseException:
        await deliverer.close()
        await env_client.close()
        await notifier.close()
        await db.dispose()
        raise
    await runner.start()
    await deliverer.start()
    await scheduler.start()
    # Closed in reverse order: the scheduler stops delivering, then the runner
    # finishes its turns while the MCP connections, the database and the
    # environment channel are still open.
    return ServiceHandle(
        name="session",
        grpc=running,
        closers=[
            db.dispose,
            notifier.close,
            env_client.close,
            mcp.close,
            providers.close,
            traces.close,
            runner.close,
            deliverer.close,
            scheduler.close,
        ],
    )
