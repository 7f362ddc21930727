"""The docker backend's warm pool on a real engine: sandboxes of every network
policy are made of pre-started containers of their size, and nothing but
the uid shows it from inside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from conftest_docker import docker_engine, docker_test_image, remove_containers_of  # noqa: F401 (fixtures)
from waiting import wait_until

from services.core.settings import Settings
from services.sandbox.backends.base import EGRESS_SOCKET_IN_SANDBOX, BackendHandle, NetworkPolicy, SandboxSpec, egress_env
from services.sandbox.backends.docker import DockerBackend, installation_id
from services.sandbox.daemon_client import DaemonClient
from services.sandbox.isolation.quota import mounts_under, unmount_under
from services.sandbox.isolation.sizes import DEFAULT_SIZE, SIZES, ContainerSize

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

    def backend(self, pool_size: int = 1, prefill: bool = True) -> DockerBackend:
        """A backend of this data dir; with ``prefill`` the pool of the
        default size fills from ``start()``, else each size's from its first use."""
        settings = Settings(
            data_dir=self.data_dir,
            docker_image=self.image,
            docker_pool_size=pool_size,
            docker_pool_sizes=["medium"] if prefill else [],
        )
        backend = DockerBackend(settings)
        self.backends.append(backend)
        return backend

    async def started(self, pool_size: int = 1) -> DockerBackend:
        """A started backend whose pool of the default size is full."""
        backend = self.backend(pool_size)
        await backend.start()
        await self.full(backend)
        return backend

    async def full(self, backend: DockerBackend, size: ContainerSize = DEFAULT_SIZE) -> None:
        await wait_until(lambda: backend.warm_count(size) == backend.pool_size, timeout=FILL_S, what=f"{size.name} pool full")

    async def create(
        self, backend: DockerBackend, sandbox_id: str, network: NetworkPolicy = "disabled", size: ContainerSize = DEFAULT_SIZE
    ) -> BackendHandle:
        spec = SandboxSpec(
            sandbox_id=sandbox_id,
            network=network,
            env=SPEC_ENV,
            labels={**SPEC_LABELS, "berth.sandbox_id": sandbox_id},
            size=size,
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

    def networks_of(self, container_id: str) -> tuple[str, list[str]]:
        """The container's network mode and the networks it is attached to now."""
        attrs = self.engine.containers.get(container_id).attrs
        return attrs["HostConfig"]["NetworkMode"], sorted(attrs["NetworkSettings"]["Networks"])


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
    remove_containers_of(docker_engine, pools.data_dir)
    await unmount_under(pools.data_dir)


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
    "workspace_mib": os.statvfs("/workspace").f_blocks * os.statvfs("/workspace").f_frsize >> 20,
    "tmp_mib": os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize >> 20,
    "resolv_conf": read("/etc/resolv.conf"),
}))
"""


async def _probe(handle: BackendHandle) -> dict[str, Any]:
    async with DaemonClient(handle.socket_path) as client:
        result = await client.run(argv=["python3", "-c", _PROBE])
    assert result.exit_code == 0, result.stderr
    probed: dict[str, Any] = json.loads(result.stdout)
    return probed


def _without_uid(probed: dict[str, Any]) -> dict[str, Any]:
    """What a sandbox shows inside, but its uid (a pool container's is its slot's)."""
    return {k: v for k, v in probed.items() if k != "uid"}


def _engine_cpus(engine: docker.DockerClient) -> int:
    return int(engine.info()["NCPU"])


async def test_a_claimed_pool_container_becomes_the_sandbox_with_its_env_limits_and_an_empty_workspace(
    pools: Pools
) -> None:
    backend = await pools.started()
    (warm,) = pools.pool_container_ids()

    handle = await pools.create(backend, "claimed")

    size = DEFAULT_SIZE
    assert handle.private["container_id"] == warm
    assert pools.engine.containers.get(warm).name == f"berth-{pools.installation}-claimed"
    assert handle.private["labels"] == {**SPEC_LABELS, "berth.sandbox_id": "claimed"}
    assert handle.private["network"] == "disabled"
    assert handle.private["size"] == size.name
    assert Path(handle.socket_path) == pools.data_dir / "sandboxes" / "claimed" / "run" / "sandboxd.sock"
    probed = await _probe(handle)
    assert probed["uid"] == handle.private["uid"] != 0
    assert {k: probed["env"].get(k) for k in SPEC_ENV} == SPEC_ENV
    assert probed["env"]["HOME"] == "/workspace"
    assert probed["workspace"] == []
    assert probed["hostname"] == "sandbox"
    assert probed["interfaces"] == ["lo"]
    assert probed["memory"] == probed["memory_and_swap"] == str(size.memory_mib * 1024 * 1024)
    cpu_millis = min(size.cpu_millis, 1000 * _engine_cpus(pools.engine))
    assert probed["cpu"] == f"{cpu_millis * 100} 100000"
    assert probed["pids"] == str(size.pids)
    assert 0.9 * size.disk_mib <= probed["workspace_mib"] <= size.disk_mib
    assert probed["tmp_mib"] == size.tmp_mib
    # What the sandbox writes lands in its own directory, not the slot's.
    async with DaemonClient(handle.socket_path) as client:
        await client.write_file("note.txt", b"mine")
    assert (Path(str(handle.private["workspace_dir"])) / "note.txt").read_bytes() == b"mine"


_ADDRESSES = r"""
import fcntl, os, socket, struct
for name in sorted(os.listdir("/sys/class/net")):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()))  # SIOCGIFADDR
        except OSError:
            continue
    print(name, socket.inet_ntoa(packed[20:24]))
"""

# Reads one line from the unix socket argv[1].
_READ_SOCKET = r"""
import socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(20)
    s.connect(sys.argv[1])
    print(s.makefile().readline().strip())
"""


@contextlib.asynccontextmanager
async def _greeting_socket(path: Path, greeting: bytes, owner: int) -> AsyncIterator[None]:
    """Serves ``greeting`` on the unix socket ``path``, bound through a short
    /proc/self/fd alias of its directory (test paths outgrow sun_path), and
    owned by the sandbox's uid ``owner`` as the egress proxy's socket is."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting + b"\n")
        await writer.drain()
        writer.close()

    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)
    os.chown(path, owner, owner)
    server = await asyncio.start_unix_server(greet, sock=sock)
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()
        path.unlink(missing_ok=True)




def _private_without_identity(handle: BackendHandle) -> Any:
    private = {k: v for k, v in handle.private.items() if k not in ("container_id", "uid", "gid", "user_network")}
    return json.loads(json.dumps(private).replace(handle.sandbox_id, "<sandbox_id>"))


@pytest.mark.parametrize("network", ["disabled", "enabled", "restricted"])
async def test_a_claimed_sandbox_looks_the_same_inside_as_a_fresh_one(
    pools: Pools, network: NetworkPolicy
) -> None:
    backend = pools.backend(pool_size=1)
    # Before start() the pool is empty: this one is a fresh container.
    fresh = await pools.create(backend, "sbx-fresh-1", network=network)
    await backend.start()
    await pools.full(backend)
    warm = pools.pool_container_ids()

    claimed = await pools.create(backend, "sbx-pooled-1", network=network)

    assert fresh.private["container_id"] not in warm
    assert claimed.private["container_id"] in warm
    assert claimed.private["network"] == network
    assert pools.networks_of(str(claimed.private["container_id"])) == pools.networks_of(str(fresh.private["container_id"]))
    assert _without_uid(await _probe(claimed)) == _without_uid(await _probe(fresh))
    assert _private_without_identity(claimed) == _private_without_identity(fresh)
    assert ("user_network" in claimed.private) == ("user_network" in fresh.private) == (network == "enabled")


async def test_the_pool_refills_after_a_claim(pools: Pools) -> None:
    backend = await pools.started()
    (first,) = pools.pool_container_ids()

    await pools.create(backend, "takes-the-first")

    await pools.full(backend)
    (second,) = pools.pool_container_ids()
    assert second != first
    handle = await pools.create(backend, "takes-the-second")
    assert handle.private["container_id"] == second


async def test_concurrent_creates_never_share_a_container(pools: Pools) -> None:
    backend = await pools.started(pool_size=2)
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


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


async def test_an_enabled_sandbox_claimed_from_the_pool_gets_a_user_mode_network_of_its_own(
    pools: Pools
) -> None:
    backend = await pools.started()
    (warm,) = pools.pool_container_ids()

    handle = await pools.create(backend, "online", network="enabled")

    assert handle.private["container_id"] == warm
    assert handle.private["network"] == "enabled"
    assert pools.networks_of(warm) == ("none", ["none"])
    slirp = int(handle.private["user_network"]["pid"])
    assert "slirp4netns" in _cmdline(slirp)[0]
    async with DaemonClient(handle.socket_path) as client:
        shown = await client.run(argv=["python3", "-c", _ADDRESSES])
    assert shown.stdout.decode().splitlines() == ["lo 127.0.0.1", "tap0 10.0.2.100"]
    assert (await _probe(handle))["resolv_conf"] == "nameserver 10.0.2.3"

    await backend.destroy(handle)

    await wait_until(lambda: "slirp4netns" not in "".join(_cmdline(slirp)), what="slirp4netns ended")


async def test_a_restricted_sandbox_is_claimed_from_the_one_pool_and_gets_the_egress_variables(
    pools: Pools
) -> None:
    backend = await pools.started()
    (warm,) = pools.pool_container_ids()

    handle = await pools.create(backend, "fenced", network="restricted")

    assert handle.private["container_id"] == warm
    assert handle.private["network"] == "restricted"
    assert pools.networks_of(warm) == ("none", ["none"])
    # The manager serves the egress proxy where the backend says; the
    # container (whose run/ was the pool slot's) finds it at /run/berth.
    egress = Path(str(backend.egress_socket_path(handle)))
    assert egress == pools.data_dir / "sandboxes" / "fenced" / "run" / "egress.sock"
    greeting = _greeting_socket(egress, b"egress served on the host", int(handle.private["uid"]))
    async with greeting, DaemonClient(handle.socket_path) as client:
        read = await client.run(argv=["python3", "-c", _READ_SOCKET, EGRESS_SOCKET_IN_SANDBOX])
    assert read.stdout == b"egress served on the host\n", read.stderr
    probed = await _probe(handle)
    assert probed["interfaces"] == ["lo"]
    assert {k: probed["env"].get(k) for k in egress_env()} == egress_env()
    assert {k: probed["env"].get(k) for k in SPEC_ENV} == SPEC_ENV


async def test_a_size_not_pre_filled_is_kept_warm_after_its_first_use(pools: Pools) -> None:
    small = SIZES["small"]
    backend = await pools.started()
    pre_filled = pools.pool_container_ids()
    assert backend.warm_count(small) == 0

    first = await pools.create(backend, "first-small", size=small)

    assert first.private["container_id"] not in pre_filled
    await pools.full(backend, small)
    warm_small = pools.pool_container_ids() - pre_filled
    assert len(warm_small) == 1
    second = await pools.create(backend, "second-small", size=small)
    assert {str(second.private["container_id"])} == warm_small
    probed = await _probe(second)
    assert probed["memory"] == str(small.memory_mib * 1024 * 1024)
    assert (probed["pids"], probed["tmp_mib"]) == (str(small.pids), small.tmp_mib)
    assert 0.9 * small.disk_mib <= probed["workspace_mib"] <= small.disk_mib
    await pools.full(backend, small)  # and it is topped up again


async def test_a_claimed_sandbox_made_again_after_its_container_died_keeps_its_files_and_uid(
    pools: Pools
) -> None:
    backend = await pools.started()
    claimed = await pools.create(backend, "phoenix")
    async with DaemonClient(claimed.socket_path) as client:
        await client.write_file("kept.txt", b"kept")
    pools.engine.containers.get(str(claimed.private["container_id"])).kill()

    again = await pools.create(backend, "phoenix")

    assert again.private["container_id"] != claimed.private["container_id"]
    assert again.private["uid"] == claimed.private["uid"]
    async with DaemonClient(again.socket_path) as client:
        result = await client.run(shell="cat kept.txt && echo more >> kept.txt && id -u")
    assert (result.exit_code, result.stdout) == (0, f"kept{claimed.private['uid']}\n".encode()), result.stderr


async def test_adopt_after_a_restart_keeps_a_claimed_sandbox_and_removes_unclaimed_pool_containers(
    pools: Pools
) -> None:
    before = await pools.started()
    claimed = await pools.create(before, "survivor")
    async with DaemonClient(claimed.socket_path) as client:
        await client.write_file("kept.txt", b"kept")
    await pools.full(before)
    assert len(pools.pool_container_ids()) == 1
    # The service dies without closing its backend; a new one adopts.

    adopted = await pools.backend().adopt()

    assert [h.sandbox_id for h in adopted] == ["survivor"]
    (handle,) = adopted
    assert handle.private["container_id"] == claimed.private["container_id"]
    assert handle.private["labels"] == {**SPEC_LABELS, "berth.sandbox_id": "survivor"}
    assert handle.private["uid"] == claimed.private["uid"]
    assert handle.socket_path == claimed.socket_path
    assert pools.pool_container_ids() == set()
    assert pools.slot_dirs() == []
    assert mounts_under(pools.data_dir / "docker" / "pool") == []
    async with DaemonClient(handle.socket_path) as client:
        result = await client.run(shell='cat kept.txt; echo " $GREETING"')
    assert result.stdout == b"kept hello pool\n"


async def test_adopt_removes_a_claimed_sandbox_whose_directory_is_gone(pools: Pools) -> None:
    backend = await pools.started()
    handle = await pools.create(backend, "orphaned")
    home = Path(str(handle.private["home"]))
    await unmount_under(home)
    await asyncio.to_thread(shutil.rmtree, home)

    assert await pools.backend().adopt() == []

    assert not await backend.is_alive(handle)


async def test_destroying_a_pooled_sandbox_removes_its_container_filesystems_and_directory(
    pools: Pools
) -> None:
    backend = await pools.started()
    handle = await pools.create(backend, "short-lived")
    home = Path(str(handle.private["home"]))
    assert home.is_dir()
    assert mounts_under(home) == [home / "workspace"]

    await backend.destroy(handle)

    with pytest.raises(docker.errors.NotFound):
        pools.engine.containers.get(str(handle.private["container_id"]))
    assert mounts_under(home) == []
    assert not home.exists()
    assert not await backend.is_alive(handle)


async def test_pause_and_resume_work_on_a_pooled_sandbox(pools: Pools) -> None:
    backend = await pools.started()
    handle = await pools.create(backend, "sleepy")

    await backend.pause(handle)
    assert pools.engine.containers.get(str(handle.private["container_id"])).status == "paused"
    await backend.resume(handle)

    async with DaemonClient(handle.socket_path) as client:
        assert (await client.run(argv=["true"])).exit_code == 0


async def test_a_dead_pool_container_is_discarded_and_the_sandbox_starts_fresh(pools: Pools) -> None:
    backend = await pools.started()
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
    pools: Pools
) -> None:
    backend = await pools.started(pool_size=2)
    handle = await pools.create(backend, "outlives-the-pool")

    await backend.close()

    assert pools.pool_container_ids() == set()
    assert pools.slot_dirs() == []
    assert mounts_under(pools.data_dir / "docker" / "pool") == []
    assert await backend.is_alive(handle)
