"""Fixtures: the gateway on a real uvicorn port (port 0) in front of the
in-test gRPC fakes of gateway_support, plus a full-scope key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.app import start_gateway
from gateway.keys import create_key
from gateway_support import FakeEnvironmentService, FakeSessionService, Stack, serve_environment, serve_session
from services.core.grpc_server import RunningServer
from services.core.settings import Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        max_body_bytes=64 * 1024,
        rpc_timeout_s=5,
        grace_s=1,
        sse_keepalive_s=30,
    )


@pytest.fixture
async def stack(settings: Settings) -> AsyncIterator[Stack]:
    environment = FakeEnvironmentService()
    session = FakeSessionService(environment)
    servers: list[RunningServer] = [await serve_environment(environment), await serve_session(session)]
    gateway = await start_gateway(
        settings,
        port=0,
        host="127.0.0.1",
        environment_addr=f"127.0.0.1:{servers[0].port}",
        session_addr=f"127.0.0.1:{servers[1].port}",
    )
    record, key = await create_key(gateway.app.state.berth.db, "acme", ["tasks:read", "tasks:write"])
    try:
        yield Stack(gateway, session, environment, settings, key, record.org_id)
    finally:
        await gateway.stop()
        for server in servers:
            await server.stop(0)
