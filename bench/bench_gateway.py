"""The gateway's own overhead: an authenticated GET of a missing environment
(auth, one gRPC hop to the Environment service, a 404 envelope) against a
bare FastAPI route on uvicorn, both under the same concurrent load from an
httpx client on loopback, in one process and one run."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from bench.runner import Result, measure_concurrent, summarize
from gateway.app import start_gateway
from gateway.keys import create_key
from services.core.settings import Settings
from services.environment.server import start_environment_service
from services.sandbox.server import start_sandbox_service
from services.session.server import start_session_service

TOTAL = 2000
CONCURRENCY = 16


async def _bare_server() -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    app = FastAPI()

    @app.get("/v1/agents/environments/{environment_id}")
    async def missing(environment_id: str) -> dict[str, str]:
        return {"id": environment_id}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


async def run(tmp: Path) -> list[Result]:
    settings = Settings(data_dir=tmp / "berth", sandbox_idle_pause_s=0, log_level="ERROR")
    sandbox = await start_sandbox_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"sandbox_addr": sandbox.address})
    environment = await start_environment_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"environment_addr": environment.address})
    session = await start_session_service(settings, address="127.0.0.1:0")
    settings = settings.model_copy(update={"session_addr": session.address})
    gateway = await start_gateway(settings, port=0)
    bare, bare_task, bare_port = await _bare_server()
    try:
        _, key = await create_key(gateway.database, "bench", ["tasks:read", "tasks:write"])
        headers = {"Authorization": f"Bearer {key}", "OpenAI-Beta": "agents=v1"}
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(headers=headers, limits=limits) as client:
            missing = f"http://127.0.0.1:{gateway.port}/v1/agents/environments/env_000000000doesnotexist000"
            bare_url = f"http://127.0.0.1:{bare_port}/v1/agents/environments/env_000000000doesnotexist000"

            async def via_gateway() -> None:
                resp = await client.get(missing)
                assert resp.status_code == 404, resp.text

            async def via_bare() -> None:
                resp = await client.get(bare_url)
                assert resp.status_code == 200

            base = await measure_concurrent(via_bare, total=TOTAL, concurrency=CONCURRENCY)
            gw = await measure_concurrent(via_gateway, total=TOTAL, concurrency=CONCURRENCY)
        return [summarize(f"gateway GET missing env (c={CONCURRENCY})", gw, "bare FastAPI route, same load", base)]
    finally:
        bare.should_exit = True
        await bare_task
        await gateway.stop()
        await session.stop(0.2)
        await environment.stop(0.2)
        await sandbox.stop(0.2)
