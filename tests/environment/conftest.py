"""Fixtures for Environment service tests: databases (SQLite and
PostgreSQL), the service on port 0 with the in-memory compute or the real
Sandbox service."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from environment_fakes import FakeCompute
from environment_helpers import Cluster, EnvService, SandboxNodePool, SandboxService, destroy_environment_sandboxes
from grpc_support import internal_channel

from berth.sandbox.v1 import sandbox_service_pb2_grpc
from services.core.settings import Settings

def _require_or_skip(what: str, flag: str, reason: str) -> None:
    if os.environ.get(flag) == "1":
        pytest.fail(f"{what} is required ({flag}=1) but unavailable: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The Environment service database, once on SQLite and once on PostgreSQL
    (an empty schema per test)."""
    if request.param == "sqlite":
        return f"sqlite+berth:///{tmp_path / 'environment.db'}"
    import asyncpg

    dsn: str = request.getfixturevalue("postgres_database")
    conn = await asyncpg.connect(dsn, timeout=3)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
    finally:
        await conn.close()
    return dsn


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+berth:///{tmp_path / 'environment.db'}"


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
async def sandbox_service(tmp_path: Path) -> AsyncIterator[SandboxService]:
    """The real Sandbox service on bubblewrap; its sandboxes are destroyed at teardown."""
    if shutil.which("bwrap") is None:
        _require_or_skip("bubblewrap", "BERTH_REQUIRE_BWRAP", "bwrap is not installed (apt-get install -y bubblewrap)")
    from services.sandbox.server import start_sandbox_service

    settings = Settings(data_dir=tmp_path / "sandbox", sandbox_idle_pause_s=0)
    handle = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(handle.address)
    service = SandboxService(handle, channel, sandbox_service_pb2_grpc.SandboxServiceStub(channel))
    try:
        yield service
    finally:
        await destroy_environment_sandboxes(service.stub)
        await channel.close()
        await handle.stop(0.2)


@pytest.fixture
async def sandbox_nodes(tmp_path: Path) -> AsyncIterator[SandboxNodePool]:
    """Two real Sandbox services on bubblewrap, nodes ``a`` and ``b``; every
    sandbox on them is destroyed at teardown."""
    if shutil.which("bwrap") is None:
        _require_or_skip("bubblewrap", "BERTH_REQUIRE_BWRAP", "bwrap is not installed (apt-get install -y bubblewrap)")
    pool = SandboxNodePool(tmp_path)
    try:
        await pool.start("a")
        await pool.start("b")
        yield pool
    finally:
        await pool.close()
