"""Composition root of the Environment service."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from berth.environment.v1 import (
    environment_service_pb2,
    environment_service_pb2_grpc,
    vault_service_pb2,
    vault_service_pb2_grpc,
)
from services.core.context import PeerCredentials
from services.core.db import open_database
from services.core.grpc_server import start_grpc_server
from services.core.interceptors import allowed_callers
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.environment.compute import Compute, SandboxClient, SandboxInventory, open_sandbox_channel
from services.environment.domain import EnvironmentDomain
from services.environment.file_store import FileStore
from services.environment.init_guard import InitGuard
from services.environment.sandbox_nodes import SandboxNodes
from services.environment.sandbox_reconciler import SandboxReconciler
from services.environment.secret_sync import SandboxSecretSync
from services.environment.servicer import EnvironmentServicer
from services.environment.setup_steps import EnvironmentSetup
from services.environment.status_gauge import EnvironmentStatusGauge
from services.environment.vault_servicer import VaultServicer
from services.environment.oauth_refresh import TokenEndpointClient
from services.environment.vaults import VaultStore, vault_key_ring
from services.environment.templates import EnvironmentTemplates

__all__ = ["start_environment_service", "ENVIRONMENT_CALLERS", "VAULT_CALLERS"]

_MIGRATIONS = Path(__file__).parent / "migrations" / "versions"
_SERVICE = environment_service_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]

# Who calls what (grep gateway/routes and services/session/environment_client.py):
# the gateway serves the environments and files APIs, the Session service
# runs sessions on environments, and `berth mcp list` reads the brokers.
ENVIRONMENT_CALLERS = allowed_callers(
    _SERVICE,
    {
        "gateway": (
            "CreateEnvironmentTemplate",
            "GetEnvironmentTemplate",
            "ListEnvironmentTemplates",
            "UpdateEnvironmentTemplate",
            "DeleteEnvironmentTemplate",
            "CreateEnvironment",
            "GetEnvironment",
            "ListEnvironments",
            "DeleteEnvironment",
            "CreateEnvironmentFile",
            "ListEnvironmentFiles",
            "CreateStoredFile",
            "GetStoredFile",
            "GetStoredFileContent",
            "DeleteStoredFile",
            "ListStoredFiles",
        ),
        "session": (
            "CreateEnvironment",
            "GetEnvironment",
            "AttachSession",
            "DetachSession",
            "GetBinding",
            "EnsureEnvironmentReady",
            "ExecCommand",
            "ReadWorkspaceFile",
            "WriteWorkspaceFile",
            "ListWorkspaceFiles",
            "ListSessionOutputs",
            "StartMcpServer",
            "SendMcpMessage",
            "ListMcpServers",
            "StartProcess",
            "AttachProcess",
            "RunProcess",
            "KillProcess",
            "ListProcesses",
            "WriteProcessStdin",
            "RemoveWorkspaceFile",
        ),
        "cli": ("ListMcpServers",),
    },
)
_VAULT_SERVICE = vault_service_pb2.DESCRIPTOR.services_by_name["VaultService"]
# The gateway serves the vaults API; the Session service checks a session's
# vault_ids and resolves its service-origin MCP credentials.
VAULT_CALLERS = allowed_callers(
    _VAULT_SERVICE,
    {
        "gateway": (
            "CreateVault",
            "GetVault",
            "UpdateVault",
            "ListVaults",
            "DeleteVault",
            "CreateCredential",
            "GetCredential",
            "UpdateCredential",
            "ListCredentials",
            "DeleteCredential",
        ),
        "session": ("CheckVaults", "ResolveMcpCredential"),
    },
)
# How long placement waits for a node's count before skipping the node.
_PLACEMENT_TIMEOUT_S = 5.0


def _instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


async def start_environment_service(
    settings: Settings, *, address: str | None = None, compute: Compute | None = None
) -> ServiceHandle:
    """Opens the database, wires the guard and domain, starts the sandbox
    reconciler, and serves ``berth.environment.v1.EnvironmentService``.
    ``compute`` replaces the Sandbox service nodes (tests), and then no
    reconciler runs; by default it dials every node of
    ``settings.sandbox_nodes()``: ``sandbox_addrs``, or the one
    ``sandbox_addr``."""
    credentials = PeerCredentials.from_settings(settings, "environment")
    db = await open_database(settings.database_url("environment"), "environment", _MIGRATIONS, pool=settings.database_pool())
    closers: list[Callable[[], Awaitable[None]]] = [db.dispose]
    try:
        inventory: SandboxInventory | None = None
        if compute is None:
            clients: dict[str, SandboxClient] = {}
            for node, node_address in settings.sandbox_nodes().items():
                channel = open_sandbox_channel(node_address, timeout_s=settings.rpc_timeout_s, credentials=credentials)
                closers.append(channel.close)
                clients[node] = SandboxClient(channel, create_timeout_s=max(settings.rpc_timeout_s, 120.0), node=node)
            compute = inventory = SandboxNodes(
                clients, placement_timeout_s=min(settings.rpc_timeout_s, _PLACEMENT_TIMEOUT_S)
            )
        file_store = FileStore(db, settings.data_dir / "blobs", max_bytes=settings.max_body_bytes)
        gauge = EnvironmentStatusGauge(db)
        gauge.start()
        closers.append(gauge.close)
        token_endpoints = TokenEndpointClient(settings)
        closers.append(token_endpoints.close)
        vaults = VaultStore(db, vault_key_ring(settings), oauth=token_endpoints)
        guard = InitGuard(
            db,
            EnvironmentSetup(compute, file_store, db, settings, vaults=vaults),
            instance_id=_instance_id(),
            lease_s=settings.init_lease_s,
            setup_timeout_s=settings.setup_timeout_s,
            on_change=gauge.touch,
        )
        guard.start()
        closers.append(guard.close)
        await vaults.rotate()
        domain = EnvironmentDomain(db, guard, compute, file_store, settings, vaults=vaults, on_change=gauge.touch)
        servicer = EnvironmentServicer(domain, file_store, EnvironmentTemplates(db, domain.validated_config))
        secret_sync = SandboxSecretSync(db, vaults, compute)

        def register(server: grpc.aio.Server) -> list[str]:
            environment_service_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
            vault_service_pb2_grpc.add_VaultServiceServicer_to_server(VaultServicer(vaults, secret_sync), server)
            return [_SERVICE.full_name, _VAULT_SERVICE.full_name]

        running = await start_grpc_server(
            address or settings.environment_addr,
            register,
            token=credentials.token,
            callers={**ENVIRONMENT_CALLERS, **VAULT_CALLERS},
        )
        if inventory is not None and settings.environment_reconcile_interval_s > 0:
            reconciler = SandboxReconciler(
                db,
                inventory,
                interval_s=settings.environment_reconcile_interval_s,
                grace_s=settings.environment_reconcile_grace_s,
                max_fraction=settings.environment_reconcile_max_fraction,
            )
            reconciler.start()
            closers.append(reconciler.close)
    except BaseException:
        for close in reversed(closers):
            await close()
        raise
    return ServiceHandle(name="environment", grpc=running, closers=closers)
