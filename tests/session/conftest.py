"""Fixtures for the Session service: the in-process fake Environment service
and the typed client of ``session_support``, and the Session service on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_support import TEST_INTERNAL_TOKEN, internal_channel
from session_support import Client, FakeEnvironmentService

from berth.environment.v1 import environment_service_pb2, environment_service_pb2_grpc
from berth.session.v1 import session_service_pb2_grpc
from services.core.grpc_server import RunningServer, start_grpc_server
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.environment.server import ENVIRONMENT_CALLERS
from services.session.server import start_session_service



# --------------------------------------------------------------------------- fixtures
@pytest.fixture
async def fake_env(tmp_path: Path) -> AsyncIterator[tuple[FakeEnvironmentService, RunningServer]]:
    service = FakeEnvironmentService(tmp_path / "fake-env")

    def register(server: grpc.aio.Server) -> list[str]:
        environment_service_pb2_grpc.add_EnvironmentServiceServicer_to_server(service, server)
        return [environment_service_pb2.DESCRIPTOR.services_by_name["EnvironmentService"].full_name]

    running = await start_grpc_server("127.0.0.1:0", register, token=TEST_INTERNAL_TOKEN, callers=ENVIRONMENT_CALLERS)
    yield service, running
    await running.stop(0)
    await service.close()


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    """Every test over the gRPC surface runs on SQLite and on PostgreSQL."""
    return Settings(data_dir=tmp_path / "data", session_database_url=database_url)


@pytest.fixture
async def session_service(
    settings: Settings, fake_env: tuple[FakeEnvironmentService, RunningServer]
) -> AsyncIterator[ServiceHandle]:
    _, env_server = fake_env
    handle = await start_session_service(settings, address="127.0.0.1:0", environment_addr=f"127.0.0.1:{env_server.port}")
    yield handle
    await handle.stop(0)


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[str], Client]]:
    """Builds clients for services started by a test itself."""
    channels: list[grpc.aio.Channel] = []

    def make(address: str) -> Client:
        channel = internal_channel(address)
        channels.append(channel)
        return Client(session_service_pb2_grpc.SessionServiceStub(channel))

    yield make
    for channel in channels:
        await channel.close()


@pytest.fixture
async def client(session_service: ServiceHandle, client_for: Callable[[str], Client]) -> Client:
    return client_for(session_service.address)


@pytest.fixture
def fake(fake_env: tuple[FakeEnvironmentService, RunningServer]) -> FakeEnvironmentService:
    return fake_env[0]
