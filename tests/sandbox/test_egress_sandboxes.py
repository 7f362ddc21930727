"""``restricted`` network in real sandboxes of both backends, through the
Sandbox service: HTTP(S) leaves only through the egress proxy, and only to
allowed hosts. The targets are servers on the host's loopback, named
``localhost``, so the service allows private targets. ``docker-pool`` runs
the same on a sandbox made of a warm pool container."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import pytest_asyncio
from conftest_docker import docker_engine, docker_test_image  # noqa: F401 (fixtures)
from egress_helpers import CONNECT, DIRECT, FETCH, Target, echo_target, http_target, local_names_only  # noqa: F401 (fixture)
from grpc_support import internal_channel
from waiting import wait_until

from berth.common.v1 import common_pb2
from berth.sandbox.v1 import sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.db import open_database
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.sandbox.egress import EgressOptions, EgressProxies
from services.sandbox import server as server_module
from services.sandbox.backends.base import SandboxBackend
from services.sandbox.backends.docker import DockerBackend, installation_id
from services.sandbox.manager import CreateParams, SandboxManager
from services.sandbox.server import build_backend, start_sandbox_service

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

BACKENDS = [
    pytest.param("local", id="local"),
    pytest.param("docker", id="docker", marks=pytest.mark.docker),
    pytest.param("docker-pool", id="docker-pool", marks=pytest.mark.docker),
]
ORG = (("x-berth-org", "org_a"),)
SANDBOX = "sbx_restricted"
MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "sandbox" / "migrations" / "versions"


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Replaces the directory-wide bubblewrap check: only the local
    parameter needs bwrap (see ``settings``)."""


@pytest.fixture(scope="module", autouse=True)
def _no_remote_lookups(local_names_only: list[str]) -> Iterator[None]:
    yield
    assert local_names_only == [], "a name was looked up that only the host's DNS could answer"


@pytest.fixture(scope="module", params=BACKENDS)
def settings(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    kind: str = request.param
    data_dir = tmp_path_factory.mktemp(f"egress-{kind}")
    common: dict[str, Any] = {"data_dir": data_dir, "sandbox_idle_pause_s": 0, "sandbox_egress_allow_private": True}
    if kind == "local":
        if shutil.which("bwrap") is None:
            if os.environ.get("BERTH_REQUIRE_BWRAP") == "1":
                pytest.fail("bubblewrap is required (BERTH_REQUIRE_BWRAP=1) but bwrap is not installed")
            pytest.skip("bubblewrap (bwrap) is not installed")
        return Settings(**common)
    image = request.getfixturevalue("docker_test_image")
    if kind == "docker-pool":
        pool: dict[str, Any] = {"docker_pool_size": 1, "docker_pool_sizes": ["medium"]}
    else:
        pool = {"docker_pool_size": 0}
    return Settings(**common, sandbox_backend="docker", docker_image=image, **pool)


@dataclass
class Service:
    settings: Settings
    handle: ServiceHandle | None = None
    channel: grpc.aio.Channel | None = None
    stub: sandbox_service_pb2_grpc.SandboxServiceStub | None = None
    backend: SandboxBackend | None = None

    async def start(self) -> sandbox_service_pb2_grpc.SandboxServiceStub:
        def keep_backend(settings: Settings) -> tuple[SandboxBackend, str, str]:
            built = build_backend(settings)
            self.backend = built[0]
            return built

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(server_module, "build_backend", keep_backend)
            self.handle = await start_sandbox_service(self.settings, address="127.0.0.1:0")
        self.channel = internal_channel(self.handle.address)
        self.stub = sandbox_service_pb2_grpc.SandboxServiceStub(self.channel)
        return self.stub

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.handle is not None:
            await self.handle.stop(0.2)
        self.handle = self.channel = self.stub = self.backend = None

    async def run(self, argv: list[str], sandbox_id: str = SANDBOX) -> tuple[int, str]:
        assert self.stub is not None
        out, code = b"", None
        async for message in self.stub.Exec(pb.ExecRequest(sandbox_id=sandbox_id, argv=argv, timeout_ms=60_000), metadata=ORG):
            if message.HasField("chunk"):
                out += message.chunk.data
            else:
                code = message.exit.exit_code
        assert code is not None
        return code, out.decode()


@dataclass
class Targets:
    http: Target
    echo: Target


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def targets() -> AsyncIterator[Targets]:
    async with http_target() as http, echo_target() as echo:
        yield Targets(http, echo)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def service(settings: Settings, request: pytest.FixtureRequest) -> AsyncIterator[Service]:
    """The service with one restricted sandbox: ``localhost`` allowed, its
    subdomain ``blocked.localhost`` blocked. With a warm pool, the sandbox
    is made of a pool container."""
    svc = Service(settings)
    stub = await svc.start()
    try:
        pool = svc.backend if isinstance(svc.backend, DockerBackend) and svc.backend.pool_size else None
        if pool is not None:
            warm_count = pool.warm_count
            await wait_until(lambda: warm_count() == 1, timeout=180, what="pool warm")
        network = common_pb2.NetworkPolicy(
            access=common_pb2.NETWORK_ACCESS_RESTRICTED, allowed_domains=["localhost"], blocked_domains=["blocked.localhost"]
        )
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id=SANDBOX, network=network), metadata=ORG)
        if pool is not None:
            engine: docker.DockerClient = request.getfixturevalue("docker_engine")
            container = engine.containers.get(f"berth-{installation_id(settings.data_dir)}-{SANDBOX}")
            assert "berth.pool" in container.labels, "the sandbox was not made of a pool container"
            assert container.attrs["HostConfig"]["NetworkMode"] == "none"
        yield svc
    finally:
        if svc.stub is None:
            await svc.start()
        assert svc.stub is not None
        try:
            await svc.stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=SANDBOX), metadata=ORG)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # never made: nothing to clean up
                raise
        await svc.stop()


async def test_a_restricted_sandbox_reaches_an_allowed_host_through_the_proxy(service: Service, targets: Targets) -> None:
    before = len(targets.http.requests)

    code, out = await service.run(["python3", "-c", FETCH, f"http://localhost:{targets.http.port}/from-the-sandbox"])

    assert code == 0, out
    assert out.split(" ", 1)[0] == "200", out
    assert len(targets.http.requests) == before + 1
    assert targets.http.requests[-1].startswith(b"GET /from-the-sandbox HTTP/1.1\r\n")


async def test_a_host_that_is_not_allowed_gets_403(service: Service, targets: Targets) -> None:
    before = targets.http.connections

    code, out = await service.run(["python3", "-c", FETCH, f"http://127.0.0.1:{targets.http.port}/"])

    assert (code, out.strip()) == (0, "403")
    assert targets.http.connections == before


async def test_a_blocked_subdomain_of_an_allowed_domain_gets_403(service: Service, targets: Targets) -> None:
    before = targets.http.connections

    code, out = await service.run(["python3", "-c", FETCH, f"http://blocked.localhost:{targets.http.port}/"])

    assert (code, out.strip()) == (0, "403")
    assert targets.http.connections == before


async def test_a_direct_connection_that_bypasses_the_proxy_fails(service: Service, targets: Targets) -> None:
    before = targets.http.connections

    code, out = await service.run(["python3", "-c", DIRECT, str(targets.http.port)])

    assert code == 7, out
    assert targets.http.connections == before


async def test_a_connect_tunnel_reaches_an_allowed_host_and_port(service: Service, targets: Targets) -> None:
    code, out = await service.run(["python3", "-c", CONNECT, f"localhost:{targets.echo.port}"])
    denied_code, denied = await service.run(["python3", "-c", CONNECT, f"blocked.localhost:{targets.echo.port}"])

    assert code == 0, out
    assert out.splitlines() == ["200", "ping through the tunnel"]
    assert (denied_code, denied.strip()) == (0, "403")


async def test_the_proxy_and_its_policy_come_back_after_a_service_restart(service: Service, targets: Targets) -> None:
    await service.stop()
    await service.start()

    code, out = await service.run(["python3", "-c", FETCH, f"http://localhost:{targets.http.port}/after-restart"])
    denied_code, denied = await service.run(["python3", "-c", FETCH, f"http://blocked.localhost:{targets.http.port}/"])

    assert code == 0, out
    assert out.split(" ", 1)[0] == "200", out
    assert targets.http.requests[-1].startswith(b"GET /after-restart HTTP/1.1\r\n")
    assert (denied_code, denied.strip()) == (0, "403")


async def test_destroying_a_restricted_sandbox_stops_its_proxy(settings: Settings, targets: Targets, tmp_path: Path) -> None:
    own = settings.model_copy(update={"data_dir": tmp_path / "data"})
    db = await open_database(own.database_url("sandbox"), "sandbox", MIGRATIONS)
    backend, name, isolation = build_backend(own)
    egress = EgressProxies(EgressOptions.from_settings(own))
    manager = SandboxManager(db, backend, backend_name=name, isolation=isolation, idle_pause_s=0, egress=egress)
    await manager.start()
    try:
        network = {"access": "restricted", "allowed_domains": ["localhost"], "blocked_domains": []}
        await manager.create("org_a", CreateParams(sandbox_id="sbx_gone", labels={}, network=network, env={}, size=0))
        async with manager.operation("org_a", "sbx_gone") as client:
            fetched = await client.run(argv=["python3", "-c", FETCH, f"http://localhost:{targets.http.port}/"], timeout_s=60)
        assert fetched.stdout.startswith(b"200"), fetched.stdout + fetched.stderr
        assert egress.running("sbx_gone")

        await manager.destroy("org_a", "sbx_gone")

        assert not egress.running("sbx_gone")
    finally:
        await manager.close()
        await backend.close()
        await db.dispose()
