"""Helpers shared by the Environment service tests (imported by module name,
so it is unique across the suite)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from grpc_support import internal_channel

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb, environment_service_pb2_grpc
from berth.sandbox.v1 import sandbox_service_pb2, sandbox_service_pb2_grpc
from services.core.service import ServiceHandle
from services.core.settings import Settings
from services.environment.compute import ENVIRONMENT_LABEL, Compute
from services.environment.server import start_environment_service

EnvStub: TypeAlias = environment_service_pb2_grpc.EnvironmentServiceStub


async def destroy_environment_sandboxes(stub: sandbox_service_pb2_grpc.SandboxServiceStub) -> None:
    """Destroys every environment sandbox of every organization on one
    Sandbox service: what a test leaves behind (sandboxes outlive processes)."""
    while True:
        listed = await stub.ListLabeledSandboxes(
            sandbox_service_pb2.ListLabeledSandboxesRequest(label_key=ENVIRONMENT_LABEL), metadata=md("berth.test-cleanup")
        )
        if not listed.sandboxes:
            return
        for sandbox in listed.sandboxes:
            await stub.DestroySandbox(
                sandbox_service_pb2.DestroySandboxRequest(sandbox_id=sandbox.sandbox_id), metadata=md(sandbox.org_id)
            )


def md(org: str = "org_a") -> tuple[tuple[str, str], ...]:
    return (("x-berth-org", org),)


def reason_of(exc: grpc.aio.AioRpcError) -> str:
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    if status is None:
        return ""
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


@dataclass
class EnvService:
    handle: ServiceHandle
    channel: grpc.aio.Channel
    stub: EnvStub
    settings: Settings


@dataclass
class Cluster:
    """Started Environment service instances, stopped at teardown."""

    tmp_path: Path
    services: list[EnvService] = field(default_factory=list)

    async def start(
        self, database_url: str, *, compute: Compute | None = None, sandbox_addr: str = "127.0.0.1:1", **overrides: Any
    ) -> EnvService:
        settings = Settings(
            data_dir=self.tmp_path / "berth",
            environment_database_url=database_url,
            sandbox_addr=sandbox_addr,
            rpc_timeout_s=10,
            **overrides,
        )
        handle = await start_environment_service(settings, address="127.0.0.1:0", compute=compute)
        channel = internal_channel(handle.address)
        service = EnvService(handle, channel, environment_service_pb2_grpc.EnvironmentServiceStub(channel), settings)
        self.services.append(service)
        return service

    async def stop(self, service: EnvService) -> None:
        if service in self.services:
            self.services.remove(service)
            await service.channel.close()
            await service.handle.stop(0.2)


@dataclass
class SandboxService:
    handle: ServiceHandle
    channel: grpc.aio.Channel
    stub: sandbox_service_pb2_grpc.SandboxServiceStub

    @classmethod
    async def start(cls, settings: Settings) -> SandboxService:
        """The real Sandbox service on port 0, with an authenticated stub."""
        from services.sandbox.server import start_sandbox_service

        handle = await start_sandbox_service(settings, address="127.0.0.1:0")
        channel = internal_channel(handle.address)
        return cls(handle, channel, sandbox_service_pb2_grpc.SandboxServiceStub(channel))

    async def destroy_sandboxes(self) -> None:
        """Destroys every environment sandbox on this service."""
        await destroy_environment_sandboxes(self.stub)

    async def stop(self) -> None:
        """Stops the service; its sandboxes outlive it, as on a real host."""
        await self.channel.close()
        await self.handle.stop(0.2)

    @property
    def address(self) -> str:
        return self.handle.address

    async def read(self, sandbox_id: str, path: str, org: str = "org_a") -> bytes:
        data = b""
        request = sandbox_service_pb2.ReadFileRequest(sandbox_id=sandbox_id, path=path)
        async for chunk in self.stub.ReadFile(request, metadata=md(org)):
            data += chunk.data
        return data


@contextlib.asynccontextmanager
async def running_sandbox_service(settings: Settings) -> AsyncIterator[SandboxService]:
    """A real Sandbox service whose sandboxes are destroyed when it stops."""
    service = await SandboxService.start(settings)
    try:
        yield service
    finally:
        await service.destroy_sandboxes()
        await service.stop()


@dataclass
class SandboxNodePool:
    """Real Sandbox services as named nodes, each on its own data dir (so
    its own database and workspaces), that a test can stop and start."""

    tmp_path: Path
    running: dict[str, SandboxService] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)

    def data_dir(self, name: str) -> Path:
        return (self.tmp_path / f"node_{name}").resolve()

    def workspace(self, name: str, sandbox_id: str) -> Path:
        """Where the local backend of node ``name`` keeps a sandbox's /workspace."""
        return self.data_dir(name) / "sandboxes" / sandbox_id / "workspace"

    async def start(self, name: str) -> SandboxService:
        service = await SandboxService.start(Settings(data_dir=self.data_dir(name), sandbox_idle_pause_s=0))
        self.running[name] = service
        if name not in self.started:
            self.started.append(name)
        return service

    async def stop(self, name: str) -> None:
        """Takes the node down; its sandboxes outlive it, as on a real host."""
        await self.running.pop(name).stop()

    def addrs(self, *names: str) -> list[str]:
        """``BERTH_SANDBOX_ADDRS`` entries of running nodes, in this order."""
        return [f"{name}={self.running[name].address}" for name in names]

    async def holds(self, name: str, sandbox_id: str, org: str = "org_a") -> bool:
        try:
            await self.running[name].stub.GetSandbox(sandbox_service_pb2.GetSandboxRequest(sandbox_id=sandbox_id), metadata=md(org))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def close(self) -> None:
        """Destroys every sandbox on every node ever started (starting a
        stopped node again for that), then stops them."""
        for name in self.started:
            service = self.running.get(name) or await self.start(name)
            await service.destroy_sandboxes()
            await self.stop(name)


async def create_env(stub: EnvStub, org: str = "org_a", **kwargs: Any) -> pb.CreateEnvironmentResponse:
    config = kwargs.pop("config", None) or environment_pb2.EnvironmentConfig()
    response: pb.CreateEnvironmentResponse = await stub.CreateEnvironment(
        pb.CreateEnvironmentRequest(config=config, **kwargs), metadata=md(org)
    )
    return response


async def get_env(stub: EnvStub, environment_id: str, org: str = "org_a") -> environment_pb2.Environment:
    response = await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=environment_id), metadata=md(org))
    return response.environment


async def ensure(stub: EnvStub, environment_id: str, org: str = "org_a") -> environment_pb2.Environment:
    response = await stub.EnsureEnvironmentReady(pb.EnsureEnvironmentReadyRequest(environment_id=environment_id), metadata=md(org))
    return response.environment


async def run_command(stub: EnvStub, environment_id: str, shell: str, *, session_id: str = "", org: str = "org_a") -> tuple[int, bytes]:
    out, code = b"", None
    request = pb.ExecCommandRequest(environment_id=environment_id, session_id=session_id, shell=shell)
    async for message in stub.ExecCommand(request, metadata=md(org)):
        if message.HasField("chunk"):
            out += message.chunk.data
        else:
            code = message.exit.exit_code
    assert code is not None
    return code, out


def setup_config(*commands: str, **kwargs: Any) -> environment_pb2.EnvironmentConfig:
    return environment_pb2.EnvironmentConfig(
        setup_commands=[environment_pb2.SetupCommand(command=c) for c in commands], **kwargs
    )
