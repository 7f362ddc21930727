"""The gateway's own overhead: an authenticated GET of a missing environment
(auth, one gRPC hop to the Environment service, a 404 envelope) against a
bare FastAPI route on uvicorn served from the same process, both under the
same concurrent load in one run. The httpx load client runs in a process of
its own (``python -m bench.bench_gateway --client``), so its CPU is not
billed to the servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Response

from bench.runner import Result, measure_concurrent, run_client, summarize
from bench.stack import INTERNAL_TOKEN
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
    async def missing(environment_id: str) -> Response:
        # A ready-made response, as the gateway's routes return.
        return Response(json.dumps({"id": environment_id}), media_type="application/json")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Configured as the gateway's server is (no access log, no websockets).
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, ws="none"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, port


async def run(tmp: Path) -> list[Result]:
    settings = Settings(data_dir=tmp / "berth", sandbox_idle_pause_s=0, log_level="ERROR", internal_token=INTERNAL_TOKEN)
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
        missing = f"http://127.0.0.1:{gateway.port}/v1/agents/environments/env_000000000doesnotexist000"
        bare_url = f"http://127.0.0.1:{bare_port}/v1/agents/environments/env_000000000doesnotexist000"
        gw = await _load(missing, key, 404)
        base = await _load(bare_url, key, 200)
        return [summarize(f"gateway GET missing env (c={CONCURRENCY})", gw, "bare FastAPI route, same load", base)]
    finally:
        bare.should_exit = True
        await bare_task
        await gateway.stop()
        await session.stop(0.2)
        await environment.stop(0.2)
        await sandbox.stop(0.2)


async def _load(url: str, key: str, status: int) -> list[float]:
    """Latencies (ms) measured by the load client process."""
    return [float(v) for v in await run_client("bench.bench_gateway", url, key, str(status))]


async def _client(url: str, key: str, status: int) -> list[float]:
    headers = {"Authorization": f"Bearer {key}", "OpenAI-Beta": "agents=v1"}
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:

        async def call() -> None:
            response = await client.get(url)
            if response.status_code != status:
                raise RuntimeError(f"{url}: {response.status_code} {response.text}")

        return await measure_concurrent(call, total=TOTAL, concurrency=CONCURRENCY)


def main() -> None:
    parser = argparse.ArgumentParser(description="the benchmark's load client (run by the benchmark itself)")
    parser.add_argument("--client", nargs=3, metavar=("URL", "KEY", "STATUS"), required=True)
    url, key, status = parser.parse_args().client
    print(json.dumps(asyncio.run(_client(url, key, int(status)))))


if __name__ == "__main__":
    main()
