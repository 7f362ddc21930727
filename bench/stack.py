"""The whole system in this process, for benchmarks: sandbox, environment
and session services on port 0 and the gateway on a loopback port; and the
one internal token and channel helper every benchmark uses."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from pydantic import SecretStr

from berth.environment.v1 import environment_service_pb2 as env_pb
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc

from gateway.app import GatewayHandle, start_gateway
from gateway.keys import create_key
from services.core.context import Peer, PeerCredentials
from services.core.grpc_server import open_channel
from services.core.settings import Settings
from services.environment.server import start_environment_service
from services.sandbox.server import start_sandbox_service
from services.session.server import start_session_service

__all__ = ["BenchStack", "running_stack", "INTERNAL_TOKEN", "internal_channel", "session_then_first_command"]

# The internal token of every service a benchmark starts (one per run).
INTERNAL_TOKEN = SecretStr(secrets.token_urlsafe(32))


def internal_channel(address: str, peer: Peer) -> grpc.aio.Channel:
    """A channel to a benchmark's service that calls as ``peer``."""
    return open_channel(address, timeout_s=120, credentials=PeerCredentials(peer, INTERNAL_TOKEN.get_secret_value()))


async def session_then_first_command(
    http: httpx.AsyncClient,
    environments: env_grpc.EnvironmentServiceStub,
    org: tuple[tuple[str, str], ...],
    environment: dict[str, object],
) -> str:
    """POSTs a session with ``environment``, then runs its first command,
    ``true`` through the Environment service's ExecCommand (what the harness
    calls), until its exit status arrives; returns the session ID."""
    created = await http.post("/agents/sessions", json={"agent": {"model": "scripted"}, "environment": environment})
    created.raise_for_status()
    session_id = str(created.json()["id"])
    request = env_pb.ExecCommandRequest(environment_id=created.json()["environment"]["id"], session_id=session_id, shell="true")
    async for message in environments.ExecCommand(request, metadata=org, timeout=120):
        if message.WhichOneof("event") == "exit" and message.exit.exit_code != 0:
            raise RuntimeError(f"true exited {message.exit.exit_code}")
    return session_id


@dataclass
class BenchStack:
    settings: Settings
    gateway: GatewayHandle
    key: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "OpenAI-Beta": "agents=v1"}


@asynccontextmanager
async def running_stack(data_dir: Path, **overrides: object) -> AsyncIterator[BenchStack]:
    settings = Settings(  # type: ignore[arg-type]
        data_dir=data_dir, sandbox_idle_pause_s=0, log_level="ERROR", internal_token=INTERNAL_TOKEN, **overrides
    )
    sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"sandbox_addr": sandbox.address})
    environment = await start_environment_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"environment_addr": environment.address})
    session = await start_session_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"session_addr": session.address})
    gateway = await start_gateway(settings, port=0)
    try:
        _, key = await create_key(gateway.database, "bench", ["tasks:read", "tasks:write"])
        yield BenchStack(settings=settings, gateway=gateway, key=key)
    finally:
        await gateway.stop()
        await session.stop(0.2)
        await environment.stop(0.2)
        await sandbox.stop(0.2)
        from services.sandbox.backends.local import LocalBackend

        backend = LocalBackend(data_dir, isolation="none")
        for handle in await backend.adopt():
            await backend.destroy(handle)
