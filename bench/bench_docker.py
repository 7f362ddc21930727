"""The ``docker`` sandbox backend (BERTH_SANDBOX_BACKEND=docker, image
BERTH_DOCKER_IMAGE, default ``berth-sandbox:latest``).

Cold start: POST a session with an inline environment through the
gateway, then its first exec, ``true`` through the Environment service's
ExecCommand (what the harness calls), until its exit status arrives. That
provisions the sandbox: a container with sandboxd as its entrypoint,
claimed from the docker backend's warm pools (default BERTH_DOCKER_POOL_SIZE
and BERTH_DOCKER_POOL_NETWORKS). One row per network policy: ``disabled``;
the default, ``enabled`` (an environment without a network setting), on the
engine's enabled network; and ``restricted``, whose create also starts the
sandbox's egress proxy and sandboxd's relay to it. Baseline in the same
run: ``docker run --rm --network none <image> true`` through the Docker SDK.
Target: p50 under 500 ms. Two more rows time the backend alone
(DockerBackend.create plus one exec through sandboxd, network disabled),
with a warm pool and with none (``docker_pool_size=0``: every create starts
a fresh container, which is also what a create costs when a burst has
emptied the pool).

The pools are measured in their steady state: before every sample (of every
series, the baseline included) the run waits, untimed, until every pool is
full again, so no sample competes with a refill. The stack's pools count as
full when as many pool slot directories as their sizes add up to hold a
sandboxd that answers.

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

import httpx

from bench.runner import Result, measure, summarize
from bench.stack import INTERNAL_TOKEN, internal_channel, running_stack, session_then_first_command
from berth.environment.v1 import environment_service_pb2_grpc as env_grpc
from berth.sandbox.v1 import sandbox_service_pb2 as sbx_pb, sandbox_service_pb2_grpc as sbx_grpc
from gateway.keys import create_key
from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle
from services.sandbox.isolation.sizes import SIZES
from services.sandbox.daemon_client import probe

IMAGE = os.environ.get("BERTH_DOCKER_IMAGE", "berth-sandbox:latest")
COLD_RUNS = 15
WARM_RUNS = 200
DOCKER_EXEC_RUNS = 40
POOL_SIZE = 2
NETWORKS: dict[str, dict[str, object]] = {
    "disabled": {"access": "disabled"},
    "enabled": {},  # no network setting: the default
    "restricted": {"access": "restricted", "allowed_domains": ["example.com"]},
}
REFILL_TIMEOUT_S = 300.0
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


async def _warm_in(data_dir: Path) -> int:
    """Pool containers of a data dir whose sandboxd answers."""
    root = data_dir.resolve() / "docker" / "pool"
    slots = await asyncio.to_thread(lambda: list(root.iterdir()) if root.is_dir() else [])
    answers = await asyncio.gather(*(probe(str(slot / "run" / "sandboxd.sock")) for slot in slots))
    return sum(1 for answer in answers if answer is None)


async def _cold_start(tmp: Path, client: Any) -> list[Result]:
    """The six series run interleaved, one sample of each per round in a
    rotating order, so a busy engine (vfs copies and deletes whole image
    layers) weighs on all of them alike."""
    from services.sandbox.backends.base import SandboxSpec
    from services.sandbox.backends.docker import DockerBackend
    from services.sandbox.daemon_client import DaemonClient

    stack_dir, backend_dir, fresh_dir = tmp / "cold", tmp / "backend", tmp / "backend-no-pool"
    backend = DockerBackend(
        Settings(data_dir=backend_dir, docker_image=IMAGE, docker_pool_size=POOL_SIZE, docker_pool_sizes=["small"])
    )
    no_pool = DockerBackend(Settings(data_dir=fresh_dir, docker_image=IMAGE, docker_pool_size=0))
    await backend.start()
    try:
        async with running_stack(
            stack_dir,
            sandbox_backend="docker",
            docker_image=IMAGE,
            docker_pool_size=POOL_SIZE,
            docker_pool_sizes=["medium"],
        ) as stack:
            record, _ = await create_key(stack.gateway.database, "bench", ["tasks:read"])
            org = (("x-berth-org", record.org_id),)
            channel = internal_channel(stack.settings.environment_addr, "session")
            environments = env_grpc.EnvironmentServiceStub(channel)
            try:
                async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.headers, timeout=120) as http:

                    async def through_services(network: str) -> str:
                        environment: dict[str, object] = {"type": "openai_hosted"}
                        if NETWORKS[network]:
                            environment["network"] = NETWORKS[network]
                        return await session_then_first_command(http, environments, org, environment)

                    async def backend_alone(backend: DockerBackend, i: int) -> BackendHandle:
                        # DockerBackend.create (container up, sandboxd answering) and
                        # one exec through sandboxd: the engine's share of a cold start.
                        handle = await backend.create(SandboxSpec(sandbox_id=f"sbx_cold_{i}", size=SIZES["small"]))
                        daemon = DaemonClient(backend.socket_path(handle))
                        try:
                            if (await daemon.run(argv=["true"])).exit_code != 0:
                                raise RuntimeError("true failed")
                        finally:
                            await daemon.close()
                        return handle

                    def docker_run() -> None:
                        client.containers.run(IMAGE, ["true"], remove=True, network_mode="none")

                    async def pools_full() -> None:
                        loop = asyncio.get_running_loop()
                        deadline = loop.time() + REFILL_TIMEOUT_S
                        # The stack's sessions are medium (the default): one pool serves every policy.
                        while backend.warm_count(SIZES["small"]) < POOL_SIZE or await _warm_in(stack_dir) < POOL_SIZE:
                            if loop.time() > deadline:
                                raise RuntimeError(f"warm pools not refilled within {REFILL_TIMEOUT_S}s")
                            await asyncio.sleep(0.05)

                    kinds = (*NETWORKS, "backend", "no_pool", "baseline")
                    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
                    for i in range(COLD_RUNS + 1):  # the first round is a warm-up
                        session_ids, handles = [], []
                        # The order rotates: the engine finishes removing the
                        # previous round's containers in the background.
                        for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                            await pools_full()
                            t0 = time.perf_counter()
                            if kind in NETWORKS:
                                session_ids.append(await through_services(kind))
                            elif kind == "backend":
                                handles.append((backend, await backend_alone(backend, i)))
                            elif kind == "no_pool":
                                handles.append((no_pool, await backend_alone(no_pool, i)))
                            else:
                                await asyncio.to_thread(docker_run)
                            elapsed = (time.perf_counter() - t0) * 1000
                            if i:
                                samples[kind].append(elapsed)
                        # Not timed: deleting a session destroys its private environment's sandbox.
                        for session_id in session_ids:
                            (await http.delete(f"/agents/sessions/{session_id}")).raise_for_status()
                        for owner, handle in handles:
                            await owner.destroy(handle)
            finally:
                await channel.close()
    finally:
        await backend.close()
        for data_dir in (stack_dir, backend_dir, fresh_dir):
            await asyncio.to_thread(_remove_installation, client, data_dir.resolve())
    base = samples["baseline"]
    return [
        *(
            summarize(
                f"docker: session+exec, {network} (warm pool)",
                samples[network],
                "docker run --rm true (SDK)",
                base,
                "p50 < 500 ms",
            )
            for network in NETWORKS
        ),
        summarize("docker: backend create + first exec (warm pool)", samples["backend"], "docker run --rm true (SDK)", base),
        summarize("docker: backend create + first exec (pool empty)", samples["no_pool"], "docker run --rm true (SDK)", base),
    ]


async def _warm_exec(tmp: Path, client: Any) -> list[Result]:
    from services.sandbox.daemon_client import DaemonClient
    from services.sandbox.server import start_sandbox_service

    data_dir = tmp / "warm"
    # No warm pool: its refills would only add engine noise to the exec timings.
    settings = Settings(
        data_dir=data_dir,
        sandbox_backend="docker",
        docker_image=IMAGE,
        docker_pool_size=0,
        sandbox_idle_pause_s=0,
        log_level="ERROR",
        internal_token=INTERNAL_TOKEN,
    )
    service = await start_sandbox_service(settings, address="127.0.0.1:0")
    channel = internal_channel(service.address, "environment")
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
