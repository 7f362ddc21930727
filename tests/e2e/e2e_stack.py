"""The whole stack in-process, for the end-to-end tests: sandbox, environment
and session services on port 0, the gateway on a real uvicorn port, an
organization key, and the official ``openai`` client pointed at it.

``stack.stop_sandbox()`` / ``stack.start_sandbox()`` stop the Sandbox service
and start it again on the same address, so a test can observe how an
unreachable Sandbox service surfaces (sandboxes themselves keep running, as
they do across a real restart)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from reaping import destroy_local_sandboxes as destroy_sandboxes

from services.core.settings import Settings

__all__ = ["Stack", "start_stack", "running_stack", "destroy_sandboxes"]


async def _no_op() -> None:
    return None


@dataclass
class Stack:
    settings: Settings
    base_url: str
    key: str
    database: object
    new_key: Callable[..., Awaitable[str]]
    stop_sandbox: Callable[[], Awaitable[None]] = field(default=_no_op)
    start_sandbox: Callable[[], Awaitable[None]] = field(default=_no_op)

    @property
    def data_dir(self) -> Path:
        return Path(self.settings.data_dir)

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30)

    def aclient(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30)

    def http(self, key: str | None = None, *, beta: bool = True) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.key}"}
        if beta:
            headers["OpenAI-Beta"] = "agents=v1"
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=30)


async def start_stack(data_dir: Path, **overrides: object) -> tuple[Stack, Callable[[], Awaitable[None]]]:
    from gateway.app import start_gateway
    from gateway.keys import create_key
    from services.core.service import ServiceHandle
    from services.environment.server import start_environment_service
    from services.sandbox.server import start_sandbox_service
    from services.session.server import start_session_service

    settings = Settings(data_dir=data_dir, sandbox_idle_pause_s=0, **overrides)  # type: ignore[arg-type]
    first_sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    sandbox: ServiceHandle | None = first_sandbox
    sandbox_address = first_sandbox.address
    settings = settings.model_copy(update={"sandbox_addr": sandbox_address})
    environment = await start_environment_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"environment_addr": environment.address})
    session = await start_session_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"session_addr": session.address})
    gateway = await start_gateway(settings, port=0)
    _, key = await create_key(gateway.database, "org-a", ["tasks:read", "tasks:write"])

    async def new_key(org: str = "org-b", scopes: tuple[str, ...] = ("tasks:read", "tasks:write")) -> str:
        _, plaintext = await create_key(gateway.database, org, list(scopes))
        return plaintext

    async def stop_sandbox() -> None:
        nonlocal sandbox
        if sandbox is not None:
            running, sandbox = sandbox, None
            await running.stop(0.5)

    async def start_sandbox() -> None:
        nonlocal sandbox
        if sandbox is None:
            # The same address: the Environment service's channel reconnects.
            sandbox = await start_sandbox_service(settings, address=sandbox_address)

    async def stop() -> None:
        await gateway.stop()
        await session.stop(0.5)
        await environment.stop(0.5)
        await stop_sandbox()

    stack = Stack(
        settings=settings,
        base_url=f"http://127.0.0.1:{gateway.port}/v1",
        key=key,
        database=gateway.database,
        new_key=new_key,
        stop_sandbox=stop_sandbox,
        start_sandbox=start_sandbox,
    )
    return stack, stop


@asynccontextmanager
async def running_stack(data_dir: Path, **overrides: object) -> AsyncIterator[Stack]:
    """``start_stack``'s stack, stopped on exit, with every sandbox it made destroyed."""
    stack, stop = await start_stack(data_dir, **overrides)
    try:
        yield stack
    finally:
        await stop()
        await destroy_sandboxes(data_dir)
