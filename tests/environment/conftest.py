"""Fixtures for Environment service tests: the service on port 0 with the
in-memory compute or the real Sandbox service (the databases come from the
root conftest)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from environment_fakes import FakeCompute
from environment_helpers import Cluster, EnvService, SandboxNodePool, SandboxService, running_sandbox_service

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
    async with running_sandbox_service(Settings(data_dir=tmp_path / "sandbox", sandbox_idle_pause_s=0)) as service:
        yield service


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
