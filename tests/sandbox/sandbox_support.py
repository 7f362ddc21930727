"""Types and helpers the sandbox tests share. Test modules import them from
here (``from sandbox_support import ...``): importing ``conftest`` by name is
ambiguous when several test directories run together."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.sandbox.backends.base import BackendHandle
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient

__all__ = ["WaitFor", "wait_until", "Sandbox", "SandboxFactory", "host_listener"]

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




@contextlib.asynccontextmanager
async def host_listener(host: str, greeting: bytes = b"") -> AsyncIterator[tuple[int, list[str]]]:
    """A TCP listener on the host at ``host`` (port chosen by the kernel)
    that sends ``greeting`` and closes; yields its port and the peers it
    accepted, so a test can tell a refused probe from one that got through."""
    accepted: list[str] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(str(writer.get_extra_info("peername")))
        if greeting:
            writer.write(greeting)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(on_connect, host, 0, family=socket.AF_INET)
    try:
        yield server.sockets[0].getsockname()[1], accepted
    finally:
        server.close()
        await server.wait_closed()
