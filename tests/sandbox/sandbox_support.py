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

from services.sandbox.backends.base import BackendHandle
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient

__all__ = ["Sandbox", "SandboxFactory", "host_listener"]


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
