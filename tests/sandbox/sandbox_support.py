"""Types and helpers the sandbox tests share. Test modules import them from
here (``from sandbox_support import ...``): importing ``conftest`` by name is
ambiguous when several test directories run together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.sandbox.backends.base import BackendHandle
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient

__all__ = ["WaitFor", "wait_until", "Sandbox", "SandboxFactory"]

WaitFor = Callable[..., Awaitable[None]]


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, message: str = "") -> None:
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


