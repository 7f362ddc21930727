"""Fixtures for Environment service tests: the service on port 0 with the
in-memory compute or the real Sandbox service (the databases come from the
root conftest)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from environment_fakes import FakeCompute
from environment_helpers import ORGS, Cluster, EnvService, SandboxNodePool, SandboxService, md
from grpc_support import internal_channel

from berth.sandbox.v1 import sandbox_service_pb2, sandbox_service_pb2_grpc
from services.core.settings import Settings


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for service in list(c.services):
            await c.stop(service)


@pytest.fixture
def fake() -> FakeCompute:
    return FakeCompute()


@pytest.fixture
async def env_service(cluster: Cluster, sqlite_url: str, fake: FakeCompute) -> EnvService:
    """One Environment service on SQLite with the in-memory compute."""
    return await cluster.start(sqlite_url, compute=fake)


@pytest.fixture
async def sandbox_service(tmp_path: Path, bwrap_available: None) -> AsyncIterator[SandboxService]:
    """The real Sandbox service on bubblewrap; its sandboxes are destroyed at teardown."""
    from services.sandbox.server import start_sandbox_service

    settings = Settings(data_dir=tmp_path / "sandbox", sandbox_idle_pause_s=0)
    handle = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    service = SandboxService(handle, channel, sandbox_service_pb2_grpc.SandboxServiceStub(channel))
    try:
        yield service
    finally:
        for org in ORGS:
            listed = await service.stub.ListSandboxes(sandbox_service_pb2.ListSandboxesRequest(), metadata=md(org))
            for sandbox in listed.sandboxes:
                await service.stub.DestroySandbox(
                    sandbox_service_pb2.DestroySandboxRequest(sandbox_id=sandbox.sandbox_id), metadata=md(org)
                )
        await channel.close()
        await handle.stop(0.2)


@pytest.fixture
async def sandbox_nodes(tmp_path: Path, bwrap_available: None) -> AsyncIterator[SandboxNodePool]:
    """Two real Sandbox services on bubblewrap, nodes ``a`` and ``b``; every
    sandbox on them is destroyed at teardown."""
    pool = SandboxNodePool(tmp_path)
    try:
        await pool.start("a")
        await pool.start("b")
        yield pool
    finally:
        await pool.close()
