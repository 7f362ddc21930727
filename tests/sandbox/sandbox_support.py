"""Types and helpers the sandbox tests share. Test modules import them from
here (``from sandbox_support import ...``): importing ``conftest`` by name is
ambiguous when several test directories run together."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_support import internal_channel

from berth.sandbox.v1 import sandbox_service_pb2_grpc
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient, ExitStatus, OutputChunk
from services.sandbox.server import start_sandbox_service

__all__ = ["Sandbox", "SandboxFactory", "RestartableSandboxService", "collect_output", "host_listener"]


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


class RestartableSandboxService:
    """The Sandbox service on port 0 that a test can stop and start again
    on the same settings (so the same data directory)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.handle: ServiceHandle | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> sandbox_service_pb2_grpc.SandboxServiceStub:
        self.handle = await start_sandbox_service(self.settings, address="127.0.0.1:0")
        self.channel = internal_channel(self.handle.address)
        return sandbox_service_pb2_grpc.SandboxServiceStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.handle is not None:
            await self.handle.stop(0.2)
            self.handle = None


async def collect_output(stream: AsyncIterable[OutputChunk | ExitStatus]) -> tuple[list[OutputChunk], ExitStatus | None]:
    """Drains a daemon output stream: its chunks, and its exit status (if it ended)."""
    chunks: list[OutputChunk] = []
    status: ExitStatus | None = None
    async for item in stream:
        if isinstance(item, OutputChunk):
            chunks.append(item)
        else:
            status = item
    return chunks, status


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
