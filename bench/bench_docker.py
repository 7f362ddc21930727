"""The ``docker`` sandbox backend (BERTH_SANDBOX_BACKEND=docker, image
BERTH_DOCKER_IMAGE, default ``berth-sandbox:latest``).

Cold start: POST a session with an inline environment (network disabled)
through the gateway, then its first exec, ``true`` through the Environment
service's ExecCommand (what the harness calls), until its exit status
arrives. That provisions the sandbox: a container with sandboxd as its
entrypoint. Baseline in the same run: ``docker run --rm --network none
<image> true`` through the Docker SDK. Target: p50 under 500 ms. A second
row times the backend alone (DockerBackend.create plus one exec through
sandboxd), which separates the engine's share from the services'.

Warm exec: ``true`` in a running docker sandbox through SandboxService.Exec
(gRPC -> service -> sandboxd) and straight through DaemonClient, against
``container.exec_run("true")`` through the Docker SDK on the same container.
Target: at least 10x faster than docker exec.

Without a reachable engine or the image, prints a skip line and reports
nothing. Every container it made is removed at the end.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.runner import Result, measure, summarize
from bench.stack import running_stack
from berth.environment.v1 import environment_service_pb2 as env_pb, environment_service_pb2_grpc as env_grpc
from berth.sandbox.v1 import sandbox_service_pb2 as sbx_pb, sandbox_service_pb2_grpc as sbx_grpc
from gateway.keys import create_key
from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle

IMAGE = os.environ.get("BERTH_DOCKER_IMAGE", "berth-sandbox:latest")
COLD_RUNS = 15
WARM_RUNS = 200
DOCKER_EXEC_RUNS = 40
ORG = (("x-berth-org", "bench"),)


def _engine() -> Any:
    """The Docker client, or None (with a printed reason) when unusable."""
    try:
        import docker
        import docker.errors

        client = docker.from_env(version="auto", timeout=120)
        client.ping()
        client.images.get(IMAGE)
    except Exception as exc:
        print(f"benchmark docker skipped: engine or image {IMAGE} unavailable ({type(exc).__name__}: {exc})")
        return None
    return client


def _remove_installation(client: Any, data_dir: Path) -> None:
    """Removes every container the run left behind (normally none)."""
    from services.sandbox.backends.docker import installation_id

    label = f"berth.installation={installation_id(data_dir)}"
    for container in client.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)


async def _cold_start(tmp: Path, client: Any) -> list[Result]:
    """The three series run interleaved, one sample of each per round in a
    rotating order, so a busy engine (vfs copies and deletes whole image
    layers) weighs on all of them alike."""
    from services.sandbox.backends.base import SandboxSpec
    from services.sandbox.backends.docker import DockerBackend
    from services.sandbox.daemon_client import DaemonClient

    stack_dir, backend_dir = tmp / "cold", tmp / "backend"
    backend = DockerBackend(Settings(data_dir=backend_dir, docker_image=IMAGE))
    body = {"agent": {"model": "scripted"}, "environment": {"type": "openai_hosted", "network": {"access": "disabled"}}}
    try:
        async with running_stack(stack_dir, sandbox_backend="docker", docker_image=IMAGE) as stack:
            record, _ = await create_key(stack.gateway.database, "bench", ["tasks:read"])
            org = (("x-berth-org", record.org_id),)
            channel = grpc.aio.insecure_channel(stack.settings.environment_addr)
            environments = env_grpc.EnvironmentServiceStub(channel)
            try:
                async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.headers, timeout=120) as http:

                    async def through_services() -> str:
                        created = await http.post("/agents/sessions", json=body)
                        created.raise_for_status()
                        session_id = str(created.json()["id"])
                        request = env_pb.ExecCommandRequest(
                            environment_id=created.json()["environment"]["id"], session_id=session_id, shell="true"
                        )
                        async for message in environments.ExecCommand(request, metadata=org, timeout=120):
                            if message.WhichOneof("event") == "exit" and message.exit.exit_code != 0:
                                raise RuntimeError(f"true exited {message.exit.exit_code}")
                        return session_id

                    async def backend_alone(i: int) -> BackendHandle:
                        # DockerBackend.create (container up, sandboxd answering) and
                        # one exec through sandboxd: the engine's share of a cold start.
                        handle = await backend.create(SandboxSpec(sandbox_id=f"sbx_cold_{i}", cpu_millis=1000, memory_mib=1024))
                        daemon = DaemonClient(backend.socket_path(handle))
                        try:
                            if (await daemon.run(argv=["true"])).exit_code != 0:
                                raise RuntimeError("true failed")
                        finally:
                            await daemon.close()
                        return handle

                    def docker_run() -> None:
                        client.containers.run(IMAGE, ["true"], remove=True, network_mode="none")

                    services_ms: list[float] = []
                    backend_ms: list[float] = []
                    base: list[float] = []
                    for i in range(COLD_RUNS + 1):  # the first round is a warm-up
                        session_id, handle = "", None
                        # The order rotates: the engine finishes removing the
                        # previous round's containers in the background.
                        for kind in ("services", "backend", "baseline")[i % 3 :] + ("services", "backend", "baseline")[: i % 3]:
                            t0 = time.perf_counter()
                            if kind == "services":
                                session_id = await through_services()
                            elif kind == "backend":
                                handle = await backend_alone(i)
                            else:
                                await asyncio.to_thread(docker_run)
                            elapsed = (time.perf_counter() - t0) * 1000
                            if i:
                                {"services": services_ms, "backend": backend_ms, "baseline": base}[kind].append(elapsed)
                        # Not timed: deleting the session destroys its private environment's sandbox.
                        (await http.delete(f"/agents/sessions/{session_id}")).raise_for_status()
                        if handle is not None:
                            await backend.destroy(handle)
            finally:
                await channel.close()
    finally:
        for data_dir in (stack_dir, backend_dir):
            await asyncio.to_thread(_remove_installation, client, data_dir.resolve())
    return [
        summarize(
            "docker: session create + first exec (cold)", services_ms, "docker run --rm true (SDK)", base, "p50 < 500 ms"
        ),
        summarize("docker: backend create + first exec (cold)", backend_ms, "docker run --rm true (SDK)", base),
    ]


async def _warm_exec(tmp: Path, client: Any) -> list[Result]:
    from services.sandbox.daemon_client import DaemonClient
    from services.sandbox.server import start_sandbox_service

    data_dir = tmp / "warm"
    settings = Settings(
        data_dir=data_dir, sandbox_backend="docker", docker_image=IMAGE, sandbox_idle_pause_s=0, log_level="ERROR"
    )
    service = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = grpc.aio.insecure_channel(service.address)
    stub = sbx_grpc.SandboxServiceStub(channel)
    daemon: DaemonClient | None = None
    try:
        created = await stub.CreateSandbox(sbx_pb.CreateSandboxRequest(sandbox_id="sbx_bench_docker"), metadata=ORG)
        del created
        container = next(
            c
            for c in client.containers.list(filters={"label": "berth.sandbox_id=sbx_bench_docker"})
            if c.labels.get("berth.data_dir") == str(data_dir.resolve())
        )

        async def via_service() -> None:
            async for message in stub.Exec(sbx_pb.ExecRequest(sandbox_id="sbx_bench_docker", argv=["true"]), metadata=ORG):
                if message.WhichOneof("event") == "exit" and message.exit.exit_code != 0:
                    raise RuntimeError("true failed")

        daemon = DaemonClient(str(data_dir.resolve() / "sandboxes" / "sbx_bench_docker" / "run" / "sandboxd.sock"))

        async def via_daemon() -> None:
            assert daemon is not None
            if (await daemon.run(argv=["true"])).exit_code != 0:
                raise RuntimeError("true failed")

        def docker_exec() -> None:
            exit_code, _ = container.exec_run(["true"])
            if exit_code != 0:
                raise RuntimeError("true failed")

        service_ms = await measure(via_service, runs=WARM_RUNS)
        daemon_ms = await measure(via_daemon, runs=WARM_RUNS)
        docker_ms = await measure(lambda: asyncio.to_thread(docker_exec), runs=DOCKER_EXEC_RUNS)
        await stub.DestroySandbox(sbx_pb.DestroySandboxRequest(sandbox_id="sbx_bench_docker"), metadata=ORG)
    finally:
        if daemon is not None:
            await daemon.close()
        await channel.close()
        await service.stop(0.2)
        await asyncio.to_thread(_remove_installation, client, data_dir.resolve())
    return [
        summarize("docker: SandboxService.Exec(true), warm", service_ms, "docker exec true (SDK)", docker_ms, "p50 <= 0.1x"),
        summarize("docker: sandboxd DaemonClient run(true), warm", daemon_ms, "docker exec true (SDK)", docker_ms, "p50 <= 0.1x"),
    ]


async def run(tmp: Path) -> list[Result]:
    client = await asyncio.to_thread(_engine)
    if client is None:
        return []
    try:
        return [*await _cold_start(tmp, client), *await _warm_exec(tmp, client)]
    finally:
        client.close()
