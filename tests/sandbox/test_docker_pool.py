"""The docker backend's warm pool on a real engine: sandboxes without network
are made of pre-started containers, and nothing shows it from inside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from sandbox_support import WaitFor
from conftest_docker import docker_engine, docker_test_image  # noqa: F401 (fixtures)

from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle, NetworkPolicy, SandboxSpec
from services.sandbox.backends.docker import DockerBackend, installation_id
from services.sandbox.daemon_client import DaemonClient

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

# Starting a container copies the image on the vfs driver: seconds each, more
# on a busy engine.
FILL_S = 180.0
SPEC_ENV = {"GREETING": "hello pool", "SECOND": "2"}
SPEC_LABELS = {"berth.org": "org_a", "berth.environment_id": "env_1"}


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Docker sandboxes need no bubblewrap."""


@dataclass
class Pools:
    engine: docker.DockerClient
    image: str
    data_dir: Path
    backends: list[DockerBackend] = field(default_factory=list)
    made: list[tuple[DockerBackend, BackendHandle]] = field(default_factory=list)

    @property
    def installation(self) -> str:
        return installation_id(self.data_dir)

    def backend(self, pool_size: int = 1) -> DockerBackend:
        backend = DockerBackend(Settings(data_dir=self.data_dir, docker_image=self.image, docker_pool_size=pool_size))
        self.backends.append(backend)
        return backend

    async def started(self, wait_for: WaitFor, pool_size: int = 1) -> DockerBackend:
        """A started backend whose pool is full."""
        backend = self.backend(pool_size)
        await backend.start()
        await self.full(backend, wait_for)
        return backend

    async def full(self, backend: DockerBackend, wait_for: WaitFor) -> None:
        await wait_for(lambda: backend.warm_count() == backend.pool_size, timeout=FILL_S, message="pool full")

    async def create(self, backend: DockerBackend, sandbox_id: str, network: NetworkPolicy = "disabled") -> BackendHandle:
        spec = SandboxSpec(
            sandbox_id=sandbox_id,
            network=network,
            env=SPEC_ENV,
            labels={**SPEC_LABELS, "berth.sandbox_id": sandbox_id},
            cpu_millis=500,
            memory_mib=256,
        )
        handle = await backend.create(spec)
        self.made.append((backend, handle))
        return handle

    def pool_container_ids(self) -> set[str]:
        """Unclaimed pool containers of this installation on the engine."""
        filters = {"label": ["berth.pool", f"berth.installation={self.installation}"]}
        return {str(c.id) for c in self.engine.containers.list(all=True, filters=filters) if ".pool-" in str(c.name)}

    def slot_dirs(self) -> list[Path]:
        root = self.data_dir / "docker" / "pool"
        return sorted(root.iterdir()) if root.is_dir() else []


@pytest.fixture
async def pools(docker_engine: docker.DockerClient, docker_test_image: str, tmp_path: Path) -> AsyncIterator[Pools]:
    pools = Pools(docker_engine, docker_test_image, (tmp_path / "data").resolve())
    yield pools
    for backend, handle in pools.made:
        with contextlib.suppress(Exception):
            await backend.destroy(handle)
    for backend in pools.backends:
        await backend.close()
    # Whatever a failed test left behind.
    label = f"berth.installation={pools.installation}"
    for container in docker_engine.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)


_PROBE = r"""
import json, os, socket

def read(*paths):
    for path in paths:
        try:
            with open(path) as handle:
                return handle.read().strip()
        except OSError:
            pass
    return None

print(json.dumps({
    "env": {k: v for k, v in os.environ.items() if k != "BERTH_PROCESS_ID"},
    "hostname": socket.gethostname(),
    "cwd": os.getcwd(),
    "uid": os.getuid(),
    "workspace": sorted(os.listdir("/workspace")),
    "interfaces": sorted(os.listdir("/sys/class/net")),
    "mount_points": sorted(line.split()[4] for line in open("/proc/self/mountinfo")),
    "ca_bundle": read("/opt/berth/ca-certificates.crt") is not None,
    "memory": read("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    "memory_and_swap": read("/sys/fs/cgroup/memory.swap.max", "/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"),
    "cpu": read("/sys/fs/cgroup/cpu.max")
        or "%s %s" % (read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")),
    "pids": read("/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids/pids.max"),
}))
"""


async def _probe(handle: BackendHandle) -> dict[str, Any]:
    async with DaemonClient(handle.socket_path) as client:
        result = await client.run(argv=["python3", "-c", _PROBE])
    assert result.exit_code == 0, result.stderr
    probed: dict[str, Any] = json.loads(result.stdout)
    return probed


async def test_a_claimed_pool_container_becomes_the_sandbox_with_its_env_limits_and_an_empty_workspace(
    pools: Pools, wait_for: WaitFor
) -> None:
    backend = await pools.started(wait_for)
    (warm,) = pools.pool_container_ids()

    handle = await pools.create(backend, "claimed")

    assert handle.private["container_id"] == warm
    assert pools.engine.containers.get(warm).name == f"berth-{pools.installation}-claimed"
    assert handle.private["labels"] == {**SPEC_LABELS, "berth.sandbox_id": "claimed"}
    assert handle.private["network"] == "disabled"
    assert Path(handle.socket_path) == pools.data_dir / "sandboxes" / "claimed" / "run" / "sandboxd.sock"
    probed = await _probe(handle)
    assert {k: probed["env"].get(k) for k in SPEC_ENV} == SPEC_ENV
    assert probed["workspace"] == []
    assert probed["hostname"] == "sandbox"
    assert probed["interfaces"] == ["lo"]
    assert probed["memory"] == str(256 * 1024 * 1024)
    assert probed["cpu"] == "50000 100000"  # 500 millicores
    # What the sandbox writes lands in its own directory, not the slot's.
    async with DaemonClient(handle.socket_path) as client:
        await client.write_file("note.txt", b"mine")
    assert (Path(str(handle.private["workspace_dir"])) / "note.txt").read_bytes() == b"mine"


def _private_without_identity(handle: BackendHandle) -> Any:
    private = {k: v for k, v in handle.private.items() if k != "container_id"}
    return json.loads(json.dumps(private).replace(handle.sandbox_id, "<sandbox_id>"))


async def test_a_claimed_sandbox_looks_the_same_inside_as_a_fresh_one(pools: Pools, wait_for: WaitFor) -> None:
    backend = pools.backend(pool_size=1)
    # Before start() the pool is empty: this one is a fresh container.
    fresh = await pools.create(backend, "sbx-fresh-1")
    await backend.start()
    await pools.full(backend, wait_for)
    warm = pools.pool_container_ids()

    claimed = await pools.create(backend, "sbx-pooled-1")

    assert fresh.private["container_id"] not in warm
    assert claimed.private["container_id"] in warm
    assert await _probe(claimed) == await _probe(fresh)
    assert _private_without_identity(claimed) == _private_without_identity(fresh)


async def test_the_pool_refills_after_a_claim(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    (first,) = pools.pool_container_ids()

    await pools.create(backend, "takes-the-first")

    await pools.full(backend, wait_for)
    (second,) = pools.pool_container_ids()
    assert second != first
    handle = await pools.create(backend, "takes-the-second")
    assert handle.private["container_id"] == second


async def test_concurrent_creates_never_share_a_container(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for, pool_size=2)
    warm = pools.pool_container_ids()

    handles = await asyncio.gather(*(pools.create(backend, f"racer-{i}") for i in range(3)))

    ids = [str(h.private["container_id"]) for h in handles]
    assert len(set(ids)) == 3
    assert len(warm & set(ids)) == 2  # the third found the pool empty and got a fresh one
    for handle in handles:
        async with DaemonClient(handle.socket_path) as client:
            await client.write_file("owner.txt", handle.sandbox_id.encode())
    for handle in handles:
        async with DaemonClient(handle.socket_path) as client:
            listing = await client.run(shell="cat owner.txt; ls -A")
        assert listing.stdout == f"{handle.sandbox_id}owner.txt\n".encode()


async def test_a_sandbox_with_network_is_not_made_from_the_pool(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    warm = pools.pool_container_ids()

    handle = await pools.create(backend, "networked", network="enabled")

    assert handle.private["container_id"] not in warm
    assert backend.warm_count() == 1
    assert pools.pool_container_ids() == warm


async def test_adopt_after_a_restart_keeps_a_claimed_sandbox_and_removes_unclaimed_pool_containers(
    pools: Pools, wait_for: WaitFor
) -> None:
    before = await pools.started(wait_for)
    claimed = await pools.create(before, "survivor")
    async with DaemonClient(claimed.socket_path) as client:
        await client.write_file("kept.txt", b"kept")
    await pools.full(before, wait_for)
    assert len(pools.pool_container_ids()) == 1
    # The service dies without closing its backend; a new one adopts.

    adopted = await pools.backend().adopt()

    assert [h.sandbox_id for h in adopted] == ["survivor"]
    (handle,) = adopted
    assert handle.private["container_id"] == claimed.private["container_id"]
    assert handle.private["labels"] == {**SPEC_LABELS, "berth.sandbox_id": "survivor"}
    assert handle.socket_path == claimed.socket_path
    assert pools.pool_container_ids() == set()
    assert pools.slot_dirs() == []
    async with DaemonClient(handle.socket_path) as client:
        result = await client.run(shell='cat kept.txt; echo " $GREETING"')
    assert result.stdout == b"kept hello pool\n"


async def test_adopt_removes_a_claimed_sandbox_whose_directory_is_gone(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    handle = await pools.create(backend, "orphaned")
    await asyncio.to_thread(shutil.rmtree, Path(str(handle.private["home"])))

    assert await pools.backend().adopt() == []

    assert not await backend.is_alive(handle)


async def test_destroying_a_pooled_sandbox_removes_its_container_and_directory(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    handle = await pools.create(backend, "short-lived")
    home = Path(str(handle.private["home"]))
    assert home.is_dir()

    await backend.destroy(handle)

    with pytest.raises(docker.errors.NotFound):
        pools.engine.containers.get(str(handle.private["container_id"]))
    assert not home.exists()
    assert not await backend.is_alive(handle)


async def test_pause_and_resume_work_on_a_pooled_sandbox(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    handle = await pools.create(backend, "sleepy")

    await backend.pause(handle)
    assert pools.engine.containers.get(str(handle.private["container_id"])).status == "paused"
    await backend.resume(handle)

    async with DaemonClient(handle.socket_path) as client:
        assert (await client.run(argv=["true"])).exit_code == 0


async def test_a_dead_pool_container_is_discarded_and_the_sandbox_starts_fresh(pools: Pools, wait_for: WaitFor) -> None:
    backend = await pools.started(wait_for)
    (dead,) = pools.pool_container_ids()
    pools.engine.containers.get(dead).kill()

    handle = await pools.create(backend, "after-a-death")

    assert handle.private["container_id"] != dead
    with pytest.raises(docker.errors.NotFound):
        pools.engine.containers.get(dead)
    probed = await _probe(handle)
    assert probed["workspace"] == []
    assert probed["env"]["GREETING"] == "hello pool"


async def test_closing_the_backend_removes_unclaimed_pool_containers_but_not_sandboxes(
    pools: Pools, wait_for: WaitFor
) -> None:
    backend = await pools.started(wait_for, pool_size=2)
    handle = await pools.create(backend, "outlives-the-pool")

    await backend.close()

    assert pools.pool_container_ids() == set()
    assert pools.slot_dirs() == []
    assert await backend.is_alive(handle)
