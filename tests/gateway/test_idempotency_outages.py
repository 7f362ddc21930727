"""Idempotency-Key across an upstream outage: a request that was never sent
releases its key, one that may have been applied stays bound to it, and a
request made while a service restarts waits for it.

The Environment service here is a real gRPC server (the gateway_support
fake behind it) that the tests stop and start again on the same port."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import GatewayHandle, start_gateway
from gateway.keys import create_key
from gateway_support import BETA, FakeEnvironmentService, FakeSessionService, serve_environment, serve_session
from services.core.grpc_server import RunningServer
from services.core.settings import Settings

BODY = {"environment": {"type": "openai_hosted"}}
_WAIT_S = 1.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _BlockingEnvironments(FakeEnvironmentService):
    """CreateEnvironment applies its write, then hangs until released, so
    the test can cut the connection after the service acted."""

    def __init__(self) -> None:
        super().__init__()
        self.block = False
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def CreateEnvironment(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = await super().CreateEnvironment(request, context)
        if self.block:
            self.entered.set()
            await self.release.wait()
        return response


@dataclass
class Outages:
    gateway: GatewayHandle
    environment: _BlockingEnvironments
    session: FakeSessionService
    key: str
    port: int
    server: RunningServer | None = None

    async def start_environment(self) -> None:
        self.server = await serve_environment(self.environment, f"127.0.0.1:{self.port}")

    async def stop_environment(self) -> None:
        assert self.server is not None
        await self.server.stop(0)
        self.server = None

    async def post(self, path: str, body: dict[str, Any], key: str) -> Any:
        headers = {"Authorization": f"Bearer {self.key}", "Idempotency-Key": key, **BETA}
        async with httpx.AsyncClient(base_url=self.gateway.base_url, headers=headers, timeout=10) as client:
            return await client.post(path, json=body)


@pytest.fixture
async def outages(tmp_path: Path) -> AsyncIterator[Outages]:
    settings = Settings(data_dir=tmp_path, rpc_timeout_s=5, grace_s=1, gateway_upstream_wait_s=_WAIT_S)
    environment = _BlockingEnvironments()
    session = FakeSessionService(environment)
    session_server = await serve_session(session)
    port = _free_port()
    gateway = await start_gateway(
        settings,
        port=0,
        host="127.0.0.1",
        environment_addr=f"127.0.0.1:{port}",
        session_addr=f"127.0.0.1:{session_server.port}",
    )
    _, key = await create_key(gateway.app.state.berth.db, "acme", ["tasks:read", "tasks:write"])
    state = Outages(gateway, environment, session, key, port)
    await state.start_environment()
    try:
        yield state
    finally:
        environment.release.set()
        await gateway.stop()
        if state.server is not None:
            await state.server.stop(0)
        await session_server.stop(0)


async def test_a_request_made_while_its_service_restarts_waits_for_it_and_succeeds(outages: Outages) -> None:
    await outages.stop_environment()
    # Restarted within the gateway's wait: the request is held, not failed.
    request = asyncio.ensure_future(outages.post("/v1/agents/environments", BODY, "restart"))
    await asyncio.sleep(_WAIT_S / 2)
    await outages.start_environment()
    response = await asyncio.wait_for(request, 10)
    assert response.status_code == 201
    assert outages.environment.count("CreateEnvironment") == 1


async def test_a_request_never_sent_to_a_service_that_stays_down_is_503_and_releases_its_key(outages: Outages) -> None:
    await outages.stop_environment()
    refused = await outages.post("/v1/agents/environments", BODY, "down")
    await outages.start_environment()
    retried = await outages.post("/v1/agents/environments", BODY, "down")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "service_unavailable")
    assert retried.status_code == 201
    assert "idempotent-replayed" not in retried.headers
    assert outages.environment.count("CreateEnvironment") == 1


async def test_a_connection_lost_after_the_service_acted_binds_the_key_to_that_failure(outages: Outages) -> None:
    outages.environment.block = True
    request = asyncio.ensure_future(outages.post("/v1/agents/environments", BODY, "lost"))
    await asyncio.wait_for(outages.environment.entered.wait(), 10)
    await outages.stop_environment()
    failed = await asyncio.wait_for(request, 10)
    outages.environment.block = False
    await outages.start_environment()
    retried = await outages.post("/v1/agents/environments", BODY, "lost")
    assert failed.status_code >= 500
    assert (retried.status_code, retried.json()) == (failed.status_code, failed.json())
    assert (retried.headers["idempotent-replayed"], retried.headers["x-should-retry"]) == ("true", "false")
    # The environment it created is not created twice.
    assert outages.environment.count("CreateEnvironment") == 1
