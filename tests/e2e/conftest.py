"""The whole stack in-process: sandbox, environment and session services on
port 0, the gateway on a real uvicorn port, an organization key, and the
official ``openai`` client pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from services.core.settings import Settings


@dataclass
class Stack:
    settings: Settings
    base_url: str
    key: str
    database: object
    new_key: Callable[..., object]

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30)

    def aclient(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key or self.key, max_retries=0, timeout=30)

    def http(self, key: str | None = None, *, beta: bool = True) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.key}"}
        if beta:
            headers["OpenAI-Beta"] = "agents=v1"
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=30)


async def start_stack(data_dir: Path, **overrides: object) -> tuple[Stack, Callable[[], object]]:
    from gateway.app import start_gateway
    from gateway.keys import create_key
    from services.environment.server import start_environment_service
    from services.sandbox.server import start_sandbox_service
    from services.session.server import start_session_service

    settings = Settings(data_dir=data_dir, sandbox_idle_pause_s=0, **overrides)  # type: ignore[arg-type]
    sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"sandbox_addr": sandbox.address})
    environment = await start_environment_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"environment_addr": environment.address})
    session = await start_session_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"session_addr": session.address})
    gateway = await start_gateway(settings, port=0)
    _, key = await create_key(gateway.database, "org-a", ["tasks:read", "tasks:write"])

    async def new_key(org: str = "org-b", scopes: tuple[str, ...] = ("tasks:read", "tasks:write")) -> str:
        _, plaintext = await create_key(gateway.database, org, list(scopes))
        return plaintext

    async def stop() -> None:
        await gateway.stop()
        await session.stop(0.5)
        await environment.stop(0.5)
        await sandbox.stop(0.5)

    stack = Stack(settings=settings, base_url=f"http://127.0.0.1:{gateway.port}/v1", key=key, database=gateway.database, new_key=new_key)
    return stack, stop


@pytest.fixture
async def stack(tmp_path: Path, bwrap_available: None) -> AsyncIterator[Stack]:
    s, stop = await start_stack(tmp_path / "berth")
    try:
        yield s
    finally:
        await stop()  # type: ignore[misc]
