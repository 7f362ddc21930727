"""Fixtures for sandbox tests: real bubblewrap sandboxes under tmp_path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sandbox_support import Sandbox, SandboxFactory

from services.sandbox.backends.base import NetworkPolicy, SandboxSpec
from services.sandbox.backends.local import Isolation, LocalBackend
from services.sandbox.daemon_client import DaemonClient
from services.sandbox.isolation.sizes import DEFAULT_SIZE, ContainerSize


@pytest.fixture(autouse=True)
def _require_bwrap(bwrap_available: None) -> None:
    """Every sandbox test here needs bubblewrap unless its module overrides this."""


@pytest.fixture
async def make_sandbox(tmp_path: Path) -> AsyncIterator[SandboxFactory]:
    created: list[Sandbox] = []

    async def make(
        sandbox_id: str = "sb",
        *,
        network: NetworkPolicy = "disabled",
        isolation: Isolation = "bwrap",
        freezer: str = "auto",
        env: dict[str, str] | None = None,
        size: ContainerSize = DEFAULT_SIZE,
        allow_cidrs: tuple[str, ...] = (),
        dormant_after_s: float = 0.0,
    ) -> Sandbox:
        backend = LocalBackend(
            tmp_path / "data",
            isolation,
            freezer=freezer,  # type: ignore[arg-type]
            allow_cidrs=allow_cidrs,
            dormant_after_s=dormant_after_s,
        )
        handle = await backend.create(SandboxSpec(sandbox_id=sandbox_id, network=network, env=env or {}, size=size))
        client = DaemonClient(backend.socket_path(handle))
        await client.connect()
        sandbox = Sandbox(backend, handle, client)
        created.append(sandbox)
        return sandbox

    yield make
    for sandbox in created:
        await sandbox.client.close()
        if await sandbox.backend.is_alive(sandbox.handle) or sandbox.workspace.exists():
            await sandbox.backend.destroy(sandbox.handle)


@pytest.fixture
async def sandbox(make_sandbox: SandboxFactory) -> Sandbox:
    return await make_sandbox()
