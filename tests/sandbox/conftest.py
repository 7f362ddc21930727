"""Fixtures for sandbox tests: real bubblewrap sandboxes under tmp_path."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.sandbox.backends.base import BackendHandle, NetworkPolicy, SandboxSpec
from services.sandbox.backends.local import Isolation, LocalBackend
from services.sandbox.daemon_client import DaemonClient

WaitFor = Callable[..., Awaitable[None]]


async def _wait_for(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, message: str = "") -> None:
    """Polls ``predicate`` until it holds, failing the test after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() >= deadline:
            pytest.fail(f"condition not met within {timeout}s: {message or predicate}")
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_for() -> WaitFor:
    return _wait_for


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.environ.get("BERTH_REQUIRE_BWRAP") == "1":
            pytest.fail("bubblewrap is required (BERTH_REQUIRE_BWRAP=1) but bwrap is not installed")
        pytest.skip("bubblewrap (bwrap) is not installed")


@dataclass
class Sandbox:
    backend: LocalBackend
    handle: BackendHandle
    client: DaemonClient

    @property
    def workspace(self) -> Path:
        return Path(str(self.handle.private["workspace_dir"]))

    @property
    def run_dir(self) -> Path:
        return Path(str(self.handle.private["run_dir"]))


SandboxFactory = Callable[..., Awaitable[Sandbox]]


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
    ) -> Sandbox:
        backend = LocalBackend(tmp_path / "data", isolation, freezer=freezer)  # type: ignore[arg-type]
        handle = await backend.create(SandboxSpec(sandbox_id=sandbox_id, network=network, env=env or {}))
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
