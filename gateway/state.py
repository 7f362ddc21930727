"""What the lifespan owns (database, gRPC channels and stubs) and the typed
dependencies that hand it to routes. Nothing here is a module global: the
state hangs off ``app.state`` for the lifetime of one app."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

import grpc
from fastapi import Depends, Request
from grpc_health.v1 import health_pb2_grpc

from berth.environment.v1 import environment_service_pb2_grpc as env_grpc, vault_service_pb2_grpc as vault_grpc
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from berth.session.v1 import automation_service_pb2_grpc as automation_grpc
from berth.session.v1 import session_service_pb2_grpc as session_grpc
from berth.session.v1 import webhook_service_pb2_grpc as webhook_grpc
from services.core.db import Database
from services.core.settings import Settings

__all__ = [
    "GatewayState",
    "get_state",
    "StateDep",
    "SessionStubDep",
    "WebhookStubDep",
    "EnvironmentStubDep",
    "VaultStubDep",
    "AutomationStubDep",
    "DatabaseDep",
    "SettingsDep",
]


@dataclass
class GatewayState:
    settings: Settings
    db: Database
    session: session_grpc.SessionServiceStub
    environment: env_grpc.EnvironmentServiceStub
    # On the Environment service's channel, which serves VaultService too.
    vaults: vault_grpc.VaultServiceStub
    # Served by the Session service, over its channel.
    automations: automation_grpc.AutomationServiceStub
    session_health: health_pb2_grpc.HealthStub
    # The Session service's webhook surface, on the session channel.
    webhooks: webhook_grpc.WebhookServiceStub
    environment_health: health_pb2_grpc.HealthStub
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    # Set when the server is stopping, so open event streams end promptly
    # instead of holding the graceful shutdown.
    closing: asyncio.Event = field(default_factory=asyncio.Event)

    async def close(self) -> None:
        self.closing.set()
        for channel in self.channels:
            await channel.close()
        await self.db.dispose()


async def get_state(request: Request) -> GatewayState:
    state = getattr(request.app.state, "berth", None)
    if not isinstance(state, GatewayState):
        raise RuntimeError("gateway state is not initialized (lifespan not running)")
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def _session_stub(state: StateDep) -> session_grpc.SessionServiceStub:
    return state.session


async def _webhook_stub(state: StateDep) -> webhook_grpc.WebhookServiceStub:
    return state.webhooks
async def _automation_stub(state: StateDep) -> automation_grpc.AutomationServiceStub:
    return state.automations


async def _environment_stub(state: StateDep) -> env_grpc.EnvironmentServiceStub:
    return state.environment


async def _vault_stub(state: StateDep) -> vault_grpc.VaultServiceStub:
    return state.vaults


async def _database(state: StateDep) -> Database:
    return state.db


async def _settings(state: StateDep) -> Settings:
    return state.settings


SessionStubDep = Annotated[session_grpc.SessionServiceStub, Depends(_session_stub)]
WebhookStubDep = Annotated[webhook_grpc.WebhookServiceStub, Depends(_webhook_stub)]
AutomationStubDep = Annotated[automation_grpc.AutomationServiceStub, Depends(_automation_stub)]
EnvironmentStubDep = Annotated[env_grpc.EnvironmentServiceStub, Depends(_environment_stub)]
VaultStubDep = Annotated[vault_grpc.VaultServiceStub, Depends(_vault_stub)]
DatabaseDep = Annotated[Database, Depends(_database)]
SettingsDep = Annotated[Settings, Depends(_settings)]
