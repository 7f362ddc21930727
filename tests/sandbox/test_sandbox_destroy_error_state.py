"""Destroying a sandbox in ``error`` state (here: one that did not survive a
restart of its Sandbox service) removes what its backend made for it, the
container and the data directory, although the service never held it live."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import grpc
import docker
import pytest
from conftest_docker import docker_engine, docker_test_image  # noqa: F401 (fixtures)
from sandbox_support import RestartableSandboxService
from waiting import wait_until

from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as pb, sandbox_service_pb2_grpc
from services.core.settings import Settings
from services.core.db import open_database
from services.core.errors import NotFound
from services.sandbox.backends.base import BackendHandle, SandboxSpec
from services.sandbox.backends.docker import installation_id
from services.sandbox.backends.local import LocalBackend
from services.sandbox.manager import CreateParams, SandboxManager

ORG = (("x-berth-org", "org_a"),)
MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "sandbox" / "migrations" / "versions"


def _kill_every_process(handle: BackendHandle) -> None:
    """SIGKILLs the sandbox's processes: bubblewrap and, through its cgroup,
    everything inside (sandboxd runs in a session of its own)."""
    pids = {int(handle.private["pid"])}
    cgroup = handle.private.get("cgroup")
    if cgroup:
        pids |= {int(p) for p in (Path(str(cgroup)) / "cgroup.procs").read_text().split()}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _none_alive(data_dir: Path) -> bool:
    return await LocalBackend(data_dir, isolation="none").adopt() == []


async def _state(stub: sandbox_service_pb2_grpc.SandboxServiceStub, sandbox_id: str) -> int:
    response = await stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id), metadata=ORG)
    return int(response.sandbox.state)


async def test_destroying_a_local_sandbox_lost_in_a_restart_deletes_its_directory(
    tmp_path: Path, bwrap_available: None
) -> None:
    service = RestartableSandboxService(Settings(data_dir=tmp_path / "berth", sandbox_idle_pause_s=0))
    home = tmp_path / "berth" / "sandboxes" / "sbx_lost"
    handle: BackendHandle | None = None
    try:
        stub = await service.start()
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_lost"), metadata=ORG)
        await service.stop()
        # The sandbox dies while no service watches it (a host reboot, an OOM kill).
        (handle,) = await LocalBackend(tmp_path / "berth", isolation="none").adopt()
        _kill_every_process(handle)
        await wait_until(lambda: _none_alive(tmp_path / "berth"), what="the sandbox died")

        stub = await service.start()
        assert await _state(stub, "sbx_lost") == sandbox_pb2.SANDBOX_STATE_ERROR
        assert home.is_dir()
        await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_lost"), metadata=ORG)
        assert not home.exists()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _state(stub, "sbx_lost")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await service.stop()
        if handle is not None and home.exists():  # the test failed half-way: leave no process behind
            with contextlib.suppress(Exception):
                await LocalBackend(tmp_path / "berth", isolation="none").destroy(handle)


class _GatedBackend(LocalBackend):
    """A local backend whose create waits at a gate once it has begun."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, isolation="bwrap")
        self.began = asyncio.Event()
        self.gate = asyncio.Event()

    async def create(self, spec: SandboxSpec) -> BackendHandle:
        self.began.set()
        await self.gate.wait()
        return await super().create(spec)


async def test_a_destroy_that_arrives_during_create_leaves_the_sandbox_destroyed(
    tmp_path: Path, bwrap_available: None
) -> None:
    data_dir = tmp_path / "berth"
    db = await open_database(Settings(data_dir=data_dir).database_url("sandbox"), "sandbox", MIGRATIONS)
    backend = _GatedBackend(data_dir)
    manager = SandboxManager(db, backend, backend_name="local", isolation="bwrap", idle_pause_s=0)
    await manager.start()
    try:
        params = CreateParams(sandbox_id="sbx_race", labels={}, network={"access": "disabled"}, env={}, size=0)
        creating = asyncio.ensure_future(manager.create("org_a", params))
        await asyncio.wait_for(backend.began.wait(), timeout=10)
        destroying = asyncio.ensure_future(manager.destroy("org_a", "sbx_race"))
        # Give the destroy every chance to finish before the create does.
        await asyncio.wait({destroying}, timeout=0.5)
        backend.gate.set()
        await asyncio.wait_for(asyncio.gather(creating, destroying, return_exceptions=True), timeout=30)
        with pytest.raises(NotFound):
            await manager.get("org_a", "sbx_race")
        assert await _none_alive(data_dir)
        assert not (data_dir / "sandboxes" / "sbx_race").exists()
    finally:
        await manager.close()
        for handle in await LocalBackend(data_dir, isolation="none").adopt():
            await LocalBackend(data_dir, isolation="none").destroy(handle)
        await db.dispose()


@pytest.mark.docker
async def test_destroying_a_docker_sandbox_lost_in_a_restart_removes_its_container_and_directory(
    tmp_path: Path, docker_engine: docker.DockerClient, docker_test_image: str  # noqa: F811 (fixtures)
) -> None:
    import docker.errors

    data_dir = tmp_path / "berth"
    settings = Settings(data_dir=data_dir, sandbox_idle_pause_s=0, sandbox_backend="docker", docker_image=docker_test_image)
    service = RestartableSandboxService(settings)
    name = f"berth-{installation_id(data_dir)}-sbx_lost"
    home = data_dir / "sandboxes" / "sbx_lost"
    try:
        stub = await service.start()
        await stub.CreateSandbox(pb.CreateSandboxRequest(sandbox_id="sbx_lost"), metadata=ORG)
        await service.stop()
        docker_engine.containers.get(name).kill()  # the container exits while no service watches it

        stub = await service.start()
        assert await _state(stub, "sbx_lost") == sandbox_pb2.SANDBOX_STATE_ERROR
        assert docker_engine.containers.get(name).status == "exited"  # kept for inspection until destroyed
        await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id="sbx_lost"), metadata=ORG)
        with pytest.raises(docker.errors.NotFound):
            docker_engine.containers.get(name)
        assert not home.exists()
    finally:
        await service.stop()
        try:
            docker_engine.containers.get(name).remove(force=True)
        except docker.errors.NotFound:
            pass
