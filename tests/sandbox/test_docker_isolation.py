"""What a hostile tenant gets in a docker sandbox: an unprivileged uid with no
capabilities, a network of its own that reaches neither another sandbox
nor the host, and limits it cannot exceed without the sandbox staying
usable. Every probe runs inside a real container on a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import pytest
from conftest_docker import docker_engine, docker_test_image, host_address, remove_containers_of  # noqa: F401 (fixtures)
from hosts_support import in_netns
from sandbox_support import host_listener
from waiting import wait_until

from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle, BackendUnavailable, NetworkPolicy, SandboxSpec
from services.sandbox.backends.docker import DockerBackend, installation_id
from services.sandbox.daemon_client import DaemonClient
from services.sandbox.isolation.quota import unmount_under
from services.sandbox.isolation.sizes import ContainerSize

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

# Small enough that the limits are reached in a second.
TINY = ContainerSize("tiny", cpu_millis=1000, memory_mib=256, pids=64, disk_mib=64, tmp_mib=16)


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Docker sandboxes need no bubblewrap."""


@dataclass
class Sandboxes:
    engine: docker.DockerClient
    image: str
    root: Path
    backends: list[DockerBackend] = field(default_factory=list)
    data_dirs: list[Path] = field(default_factory=list)
    made: list[tuple[DockerBackend, BackendHandle, DaemonClient]] = field(default_factory=list)

    def backend(self, allow_cidrs: tuple[str, ...] = ()) -> DockerBackend:
        """A backend of a data dir of its own, without a warm pool."""
        data_dir = self.root / f"data-{len(self.backends)}"
        backend = DockerBackend(
            Settings(data_dir=data_dir, docker_image=self.image, docker_pool_size=0, sandbox_allow_cidrs=list(allow_cidrs))
        )
        self.backends.append(backend)
        self.data_dirs.append(data_dir)
        return backend

    def container_name(self, backend: DockerBackend, sandbox_id: str) -> str:
        return f"berth-{installation_id(self.data_dirs[self.backends.index(backend)])}-{sandbox_id}"

    async def make(
        self,
        sandbox_id: str,
        network: NetworkPolicy = "disabled",
        size: ContainerSize = TINY,
        backend: DockerBackend | None = None,
    ) -> DaemonClient:
        if backend is None:
            backend = self.backends[0] if self.backends else self.backend()
        handle = await backend.create(SandboxSpec(sandbox_id=sandbox_id, network=network, size=size))
        client = DaemonClient(handle.socket_path)
        await client.connect()
        self.made.append((backend, handle, client))
        return client


@pytest.fixture
async def sandboxes(docker_engine: docker.DockerClient, docker_test_image: str, tmp_path: Path) -> AsyncIterator[Sandboxes]:
    made = Sandboxes(docker_engine, docker_test_image, tmp_path.resolve())
    yield made
    for backend, handle, client in made.made:
        await client.close()
        with contextlib.suppress(Exception):
            await backend.destroy(handle)
    # Whatever a failed test left behind.
    for data_dir in made.data_dirs:
        remove_containers_of(docker_engine, data_dir)
    await unmount_under(made.root)


_CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    s.sendall(b"GET /hello.txt HTTP/1.0\\r\\n\\r\\n")
    print(s.makefile("rb").read().decode(errors="replace").rsplit("\\r\\n\\r\\n", 1)[-1].strip())
except OSError as exc:
    print("blocked: %r" % exc)
    sys.exit(7)
"""


async def _connect(client: DaemonClient, host: str, port: int) -> tuple[int, str]:
    result = await client.run(argv=["python3", "-c", _CONNECT, host, str(port)], timeout_s=30)
    return result.exit_code, result.stdout.decode().strip()


async def _wait_for_exit_code(run: Callable[[], Awaitable[tuple[int, str]]], code: int, timeout: float = 20.0) -> str:
    """Runs ``run`` until it exits with ``code`` (bounded); its output."""

    async def exited_with_code() -> tuple[str] | None:
        got, output = await run()
        return (output,) if got == code else None

    (output,) = await wait_until(exited_with_code, timeout, what=f"exit code {code}")
    return output


# ---------------------------------------------------------------- identity


async def test_a_docker_sandbox_runs_as_an_unprivileged_uid_with_no_capabilities(sandboxes: Sandboxes) -> None:
    client = await sandboxes.make("who")

    uid = await client.run(argv=["id", "-u"])
    status = await client.run(shell="grep -E '^(Cap[A-Za-z]+|NoNewPrivs|Seccomp):' /proc/self/status")
    write_root = await client.run(shell="touch /etc/berth-was-here")

    assert uid.exit_code == 0 and int(uid.stdout) != 0
    fields = dict(line.split(":\t") for line in status.stdout.decode().splitlines())
    assert {k: fields[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == dict.fromkeys(
        ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), "0000000000000000"
    )
    assert (fields["NoNewPrivs"], fields["Seccomp"]) == ("1", "2")
    assert write_root.exit_code != 0  # the root filesystem is read-only


# ---------------------------------------------------------------- network


_ADDRESSES = r"""
import fcntl, os, socket, struct
for name in sorted(os.listdir("/sys/class/net")):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()))  # SIOCGIFADDR
        except OSError:
            continue
    print(socket.inet_ntoa(packed[20:24]))
"""


async def test_two_enabled_docker_sandboxes_cannot_reach_each_other(sandboxes: Sandboxes) -> None:
    server = await sandboxes.make("serves", network="enabled")
    other = await sandboxes.make("probes", network="enabled")
    await server.write_file("hello.txt", b"secret of the other org")
    await server.start_process(name="http", argv=["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"])
    # The control: the server answers inside its own sandbox.
    assert await _wait_for_exit_code(lambda: _connect(server, "127.0.0.1", 8000), 0) == "secret of the other org"
    addresses = (await server.run(argv=["python3", "-c", _ADDRESSES])).stdout.decode().split()
    assert "10.0.2.100" in addresses

    # Every address the server has, slirp's gateway and the host's own.
    for address in {*addresses, "10.0.2.2", host_address()}:
        code, output = await _connect(other, address, 8000)
        assert code == 7, (address, output)


async def test_an_enabled_docker_sandbox_cannot_reach_the_hosts_loopback_addresses_or_postgres(sandboxes: Sandboxes) -> None:
    client = await sandboxes.make("curious", network="enabled")
    own = host_address()

    async with host_listener("127.0.0.1") as (loopback_port, on_loopback), host_listener(own) as (own_port, on_own):
        targets = [
            ("127.0.0.1", loopback_port),
            (own, own_port),
            ("10.0.2.2", loopback_port),  # slirp's gateway, the host
            ("127.0.0.1", 5432),
            ("169.254.169.254", 80),  # cloud metadata
        ]
        for address, port in targets:
            code, output = await _connect(client, address, port)
            assert code == 7, (address, port, output)
        # The control: both listeners answer the host itself.
        for address, port in (("127.0.0.1", loopback_port), (own, own_port)):
            _, writer = await asyncio.open_connection(address, port)
            writer.close()
        assert (len(on_loopback), len(on_own)) == (1, 1)


@dataclass(frozen=True)
class TestHost:
    """An HTTP server in a network namespace of its own, behind a veth pair:
    a host on a private network that is not the Berth host."""

    address: str
    cidr: str
    port: int


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def test_host(tmp_path: Path) -> Iterator[TestHost]:
    if os.geteuid() != 0:
        pytest.skip("making a network namespace needs root")
    tag = secrets.token_hex(3)
    # A /30 of its own, unlikely to meet another test's at the same time.
    third, fourth = secrets.randbelow(256), secrets.randbelow(64) * 4
    net, host_side, far_side = f"10.233.{third}.{fourth}", f"10.233.{third}.{fourth + 1}", f"10.233.{third}.{fourth + 2}"
    namespace, outer, inner = f"berth-t-{tag}", f"bto{tag}", f"bti{tag}"
    served = tmp_path / "served"
    served.mkdir()
    (served / "hello.txt").write_text("hello from the test host")
    server: subprocess.Popen[bytes] | None = None
    try:
        _ip("netns", "add", namespace)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", namespace)
        _ip("addr", "add", f"{host_side}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", namespace, "addr", "add", f"{far_side}/30", "dev", inner)
        _ip("-n", namespace, "link", "set", inner, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        port = 8080
        server = subprocess.Popen(
            in_netns(namespace, [sys.executable, "-u", "-m", "http.server", str(port), "--bind", far_side,
             "--directory", str(served)]),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        # It prints "Serving HTTP on ..." once it listens.
        assert server.stdout is not None
        ready, _, _ = select.select([server.stdout], [], [], 15)
        if not ready or not server.stdout.readline().startswith(b"Serving HTTP"):
            pytest.fail("the test host's HTTP server did not start")
        yield TestHost(address=far_side, cidr=f"{net}/30", port=port)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", outer], check=False, capture_output=True)


async def test_an_enabled_docker_sandbox_reaches_an_allowed_test_host_and_not_without_the_setting(
    sandboxes: Sandboxes, test_host: TestHost
) -> None:
    allowed = await sandboxes.make("allowed", network="enabled", backend=sandboxes.backend(allow_cidrs=(test_host.cidr,)))
    refused = await sandboxes.make("refused", network="enabled", backend=sandboxes.backend())

    assert await _connect(allowed, test_host.address, test_host.port) == (0, "hello from the test host")
    code, output = await _connect(refused, test_host.address, test_host.port)
    assert code == 7, output


async def test_an_enabled_docker_sandbox_is_not_created_without_slirp4netns(
    sandboxes: Sandboxes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("nft", "nsenter", "ip"):
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True, check=True)
        (tools / tool).symlink_to(found.stdout.strip())
    monkeypatch.setenv("PATH", str(tools))
    backend = sandboxes.backend()

    with pytest.raises(BackendUnavailable, match="slirp4netns"):
        await backend.create(SandboxSpec(sandbox_id="offline", network="enabled", size=TINY))

    with pytest.raises(docker.errors.NotFound):
        sandboxes.engine.containers.get(sandboxes.container_name(backend, "offline"))


# ---------------------------------------------------------------- limits


async def test_a_command_over_the_memory_limit_is_killed_and_the_next_command_works(sandboxes: Sandboxes) -> None:
    client = await sandboxes.make("hungry")

    hog = await client.run(argv=["python3", "-c", f"b = b'x' * ({TINY.memory_mib * 2} << 20)"], timeout_s=60)
    after = await client.run(argv=["echo", "still here"])

    assert hog.exit_code in (-9, 137), hog.stderr
    assert (after.exit_code, after.stdout) == (0, b"still here\n")


_FORK_BOMB = """
import errno, os, signal
children, error = [], None
while len(children) < 100000:
    try:
        pid = os.fork()
    except OSError as exc:
        error = exc.errno
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
print(len(children), errno.errorcode.get(error, error))
"""


async def test_a_fork_bomb_stops_at_the_pids_limit_and_the_sandbox_still_answers(sandboxes: Sandboxes) -> None:
    client = await sandboxes.make("bomber")

    bomb = await client.run(argv=["python3", "-c", _FORK_BOMB], timeout_s=60)
    after = await client.run(argv=["echo", "still here"])

    assert bomb.exit_code == 0, bomb.stderr
    forked, error = bomb.stdout.decode().split()
    assert error == "EAGAIN" and int(forked) < TINY.pids
    assert (after.exit_code, after.stdout) == (0, b"still here\n")


_FILL = """
import errno, sys
try:
    with open(sys.argv[1], "wb") as f:
        for _ in range(int(sys.argv[2])):
            f.write(b"\\0" * (1 << 20))
            f.flush()
except OSError as exc:
    print(errno.errorcode[exc.errno])
    sys.exit(0)
print("no limit")
"""


async def test_writing_past_the_disk_quota_fails_with_enospc_and_the_space_comes_back(sandboxes: Sandboxes) -> None:
    client = await sandboxes.make("hoarder")

    workspace = await client.run(argv=["python3", "-c", _FILL, "/workspace/big", str(TINY.disk_mib * 2)], timeout_s=60)
    tmp = await client.run(argv=["python3", "-c", _FILL, "/tmp/big", str(TINY.tmp_mib * 2)], timeout_s=60)
    freed = await client.run(shell="rm /workspace/big && echo small > /workspace/small && cat /workspace/small")

    assert (workspace.exit_code, workspace.stdout) == (0, b"ENOSPC\n"), workspace.stderr
    assert (tmp.exit_code, tmp.stdout) == (0, b"ENOSPC\n"), tmp.stderr
    assert (freed.exit_code, freed.stdout) == (0, b"small\n"), freed.stderr
