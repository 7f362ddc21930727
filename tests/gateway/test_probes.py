"""The gateway's probes: ``/readyz`` is ready only while the Session and
Environment services answer over the gateway's own channels; ``/healthz``
(liveness) answers whatever its dependencies do."""

from __future__ import annotations

import httpx

from gateway.app import start_gateway
from gateway_support import FakeEnvironmentService, FakeSessionService, serve_environment, serve_session
from services.core.grpc_server import RunningServer
from services.core.settings import Settings
from waiting import wait_until


async def _services() -> tuple[RunningServer, RunningServer]:
    environment = FakeEnvironmentService()
    session = FakeSessionService(environment)
    env_server = await serve_environment(environment)
    session_server = await serve_session(session)
    return env_server, session_server


async def test_readyz_turns_not_ready_when_the_environment_service_stops_answering(settings: Settings) -> None:
    env_server, session_server = await _services()
    gateway = await start_gateway(
        settings,
        port=0,
        host="127.0.0.1",
        environment_addr=f"127.0.0.1:{env_server.port}",
        session_addr=f"127.0.0.1:{session_server.port}",
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as client:
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert ready.json() == {
                "status": "ok",
                "checks": {"session": "SERVING", "environment": "SERVING", "database": "SERVING"},
            }

            await env_server.stop(0)

            async def not_ready() -> httpx.Response | None:
                response = await client.get("/readyz")
                return response if response.status_code == 503 else None

            unready = await wait_until(not_ready, what="/readyz to report 503")
            live = await client.get("/healthz")
        body = unready.json()
        assert body["status"] == "unavailable"
        assert body["checks"]["session"] == "SERVING" and body["checks"]["environment"] != "SERVING"
        assert live.status_code == 200 and live.json()["status"] == "ok"
    finally:
        await gateway.stop()
        await session_server.stop(0)


async def test_readyz_is_not_ready_while_no_session_service_listens(settings: Settings) -> None:
    env_server, session_server = await _services()
    unused = session_server.port
    await session_server.stop(0)
    gateway = await start_gateway(
        settings,
        port=0,
        host="127.0.0.1",
        environment_addr=f"127.0.0.1:{env_server.port}",
        session_addr=f"127.0.0.1:{unused}",
    )
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as client:
            ready = await client.get("/readyz")
            live = await client.get("/healthz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["session"] != "SERVING"
        assert ready.json()["checks"]["environment"] == "SERVING"
        assert live.status_code == 200
    finally:
        await gateway.stop()
        await env_server.stop(0)
