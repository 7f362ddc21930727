"""One conformance suite for every sandbox backend, driven through the
backend and DaemonClient: ``local`` (bubblewrap) and ``docker``.

Tests that only run commands share one sandbox per backend; tests that
change a sandbox's lifecycle make their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest
import pytest_asyncio
from conftest_docker import docker_engine, docker_test_image  # noqa: F401 (fixtures)
from sandbox_support import collect_output, host_listener
from waiting import wait_until

from services.core.settings import Settings
from services.sandbox.backends.base import BackendHandle, BackendUnavailable, NetworkPolicy, SandboxBackend, SandboxSpec
from services.sandbox.isolation.network import host_addresses
from services.sandbox.isolation.quota import unmount_under
from services.sandbox.isolation.sizes import SIZES
from services.sandbox.backends.docker import DockerBackend
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient, DaemonError, OutputChunk

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

BACKENDS = [pytest.param("local", id="local"), pytest.param("docker", id="docker", marks=pytest.mark.docker)]


@pytest.fixture(autouse=True)
def _require_bwrap() -> None:
    """Replaces the directory-wide bubblewrap check: only the local
    parameter needs bwrap (see ``harness``)."""


# The longer bound these backends need (docker).
WAIT_S = 20.0


@dataclass
class Sandbox:
    backend: SandboxBackend
    handle: BackendHandle
    client: DaemonClient

    @property
    def workspace(self) -> Path:
        return Path(str(self.handle.private["workspace_dir"]))


@dataclass
class Harness:
    kind: str
    data_dir: Path
    new_backend: Callable[[], SandboxBackend]
    created: list[tuple[SandboxBackend, BackendHandle]] = field(default_factory=list)
    started: list[SandboxBackend] = field(default_factory=list)

    async def backend(self) -> SandboxBackend:
        """The module's started backend. The docker one keeps a warm pool
        of the sandboxes' size (serving every network policy) from the
        first sandbox on, so later sandboxes are claimed pool containers
        whenever one is ready."""
        if not self.started:
            backend = self.new_backend()
            await backend.start()
            self.started.append(backend)
        return self.started[0]

    async def make(self, sandbox_id: str, network: NetworkPolicy = "disabled", backend: SandboxBackend | None = None) -> Sandbox:
        backend = backend or await self.backend()
        handle = await backend.create(SandboxSpec(sandbox_id=sandbox_id, network=network, size=SIZES["small"]))
        self.created.append((backend, handle))
        client = DaemonClient(backend.socket_path(handle))
        await client.connect()
        return Sandbox(backend, handle, client)

    async def cleanup(self, sandbox: Sandbox) -> None:
        await sandbox.client.close()
        if await sandbox.backend.is_alive(sandbox.handle) or sandbox.workspace.exists():
            await sandbox.backend.destroy(sandbox.handle)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    kind: str = request.param
    data_dir = tmp_path_factory.mktemp(f"{kind}-data")
    if kind == "local":
        if shutil.which("bwrap") is None:
            if os.environ.get("BERTH_REQUIRE_BWRAP") == "1":
                pytest.fail("bubblewrap is required (BERTH_REQUIRE_BWRAP=1) but bwrap is not installed")
            pytest.skip("bubblewrap (bwrap) is not installed")
        harness = Harness(kind, data_dir, lambda: LocalBackend(data_dir, "bwrap"))
    else:
        request.getfixturevalue("docker_engine")
        image = request.getfixturevalue("docker_test_image")
        # No pool of the default size: the sandboxes here are small.
        settings = Settings(data_dir=data_dir, docker_image=image, docker_pool_sizes=[])
        harness = Harness(kind, data_dir, lambda: DockerBackend(settings))
    yield harness
    for backend in harness.started:
        await backend.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(harness: Harness) -> AsyncIterator[Sandbox]:
    sandbox = await harness.make("shared")
    yield sandbox
    await harness.cleanup(sandbox)


@pytest_asyncio.fixture(loop_scope="module")
async def make_sandbox(harness: Harness) -> AsyncIterator[Callable[..., Awaitable[Sandbox]]]:
    made: list[Sandbox] = []

    async def make(sandbox_id: str, network: NetworkPolicy = "disabled", backend: SandboxBackend | None = None) -> Sandbox:
        sandbox = await harness.make(sandbox_id, network, backend)
        made.append(sandbox)
        return sandbox

    yield make
    for sandbox in made:
        await harness.cleanup(sandbox)


# Lists the sandbox's live processes whose argv carries a marker word.
_FIND_MARKED = """
import os, sys
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\\0")
        state = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state != "Z" and sys.argv[1].encode() in argv:
        print(pid)
"""


async def _marked_pids(client: DaemonClient, marker: str) -> list[str]:
    result = await client.run(argv=["python3", "-c", _FIND_MARKED, marker])
    assert result.exit_code == 0, result.stderr
    return result.stdout.decode().split()


# ---------------------------------------------------------------- exec


async def test_exec_reports_exit_codes_stdout_and_stderr(shared: Sandbox) -> None:
    result = await shared.client.run(shell="echo out; echo err >&2; exit 3")
    killed = await shared.client.run(shell="kill -9 $$")
    fed = await shared.client.run(argv=["cat"], stdin=b"from stdin")

    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert killed.exit_code == -9
    assert (fed.exit_code, fed.stdout) == (0, b"from stdin")


async def test_large_output_on_both_streams_arrives_whole_without_deadlock(shared: Sandbox) -> None:
    script = (
        "import sys\n"
        "block = bytes(range(256)) * 4096\n"  # 1 MiB
        "for i in range(10):\n"
        "    sys.stdout.buffer.write(block); sys.stdout.flush()\n"
        "    sys.stderr.buffer.write(block[:102400]); sys.stderr.flush()\n"
    )
    result = await asyncio.wait_for(shared.client.run(argv=["python3", "-c", script]), 120)

    block = bytes(range(256)) * 4096
    assert result.exit_code == 0
    assert len(result.stdout) == 10 * 1024 * 1024
    assert hashlib.sha256(result.stdout).digest() == hashlib.sha256(block * 10).digest()
    assert result.stderr == block[:102400] * 10


# ---------------------------------------------------------------- background processes


async def test_background_process_survives_the_connection_that_started_it(shared: Sandbox) -> None:
    starter = DaemonClient(shared.handle.socket_path)
    proc = await starter.start_process(
        name="waiter", shell="echo started; while [ ! -e survive-go ]; do sleep 0.01; done; echo finished"
    )
    await starter.close()

    listed = {p.process_id: p for p in await shared.client.list_processes()}
    assert listed[proc.process_id].running
    await shared.client.write_file("survive-go", b"")
    status = await shared.client.wait_process(proc.process_id, timeout_s=20)
    chunks, final = await collect_output(shared.client.attach_process(proc.process_id))

    assert status is not None and status.exit_code == 0
    assert b"".join(c.data for c in chunks) == b"started\nfinished\n" and final == status


async def test_a_background_process_reads_stdin_written_to_it_until_it_is_closed(shared: Sandbox) -> None:
    reader = 'while read line; do echo "<$line>"; done'
    proc = await shared.client.start_process(name="reader", argv=["sh", "-c", reader], stdin=True)

    await shared.client.write_stdin(proc.process_id, b"a\nb\n")
    closed = await shared.client.write_stdin(proc.process_id, b"c\n", close=True)
    status = await shared.client.wait_process(proc.process_id, timeout_s=20)
    chunks, final = await collect_output(shared.client.attach_process(proc.process_id))

    assert not closed.stdin_open
    assert status is not None and status.exit_code == 0 and final == status
    assert b"".join(c.data for c in chunks) == b"<a>\n<b>\n<c>\n"


async def test_reattaching_after_a_disconnect_loses_no_output(shared: Sandbox) -> None:
    # About 1.8 MiB, more than the daemon's in-memory ring, before a pause
    # point and a little after it.
    first, total = 200_000, 200_100
    script = (
        "import os, sys, time\n"
        f"for i in range({first}): sys.stdout.write('%08d\\n' % i)\n"
        "sys.stdout.flush()\n"
        "while not os.path.exists('/workspace/reattach-go'): time.sleep(0.01)\n"
        f"for i in range({first}, {total}): sys.stdout.write('%08d\\n' % i)\n"
    )
    early_client = DaemonClient(shared.handle.socket_path)
    proc = await early_client.start_process(name="numbers", argv=["python3", "-c", script])
    early = early_client.attach_process(proc.process_id)
    seen = [await anext(early) for _ in range(3)]
    await early_client.close()

    assert all(isinstance(item, OutputChunk) for item in seen)
    await shared.client.write_file("reattach-go", b"")
    rest, status = await collect_output(shared.client.attach_process(proc.process_id, from_seq=seen[-1].seq + 1))  # type: ignore[union-attr]
    chunks = [c for c in seen if isinstance(c, OutputChunk)] + rest

    assert status is not None and status.exit_code == 0
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert b"".join(c.data for c in chunks) == b"".join(b"%08d\n" % i for i in range(total))


async def test_killing_a_process_leaves_no_descendant_alive(shared: Sandbox) -> None:
    script = (
        "python3 -c 'import time; time.sleep(600)' conformance-child &\n"
        "python3 -c 'import os, time; os.setsid(); time.sleep(600)' conformance-grandchild &\n"
        "( setsid python3 -c 'import time; time.sleep(600)' conformance-orphan & )\n"
        "wait\n"
    )
    proc = await shared.client.start_process(name="tree", shell=script)
    markers = ("conformance-child", "conformance-grandchild", "conformance-orphan")

    async def all_started() -> bool:
        return all([await _marked_pids(shared.client, m) for m in markers])

    await wait_until(all_started, WAIT_S, what="the whole tree started")
    after = await shared.client.kill_process(proc.process_id)

    assert after is not None and not after.running
    for marker in markers:
        assert await _marked_pids(shared.client, marker) == [], f"{marker} survived the kill"


# ---------------------------------------------------------------- files


async def test_paths_outside_the_workspace_are_refused(shared: Sandbox) -> None:
    link = await shared.client.run(shell="ln -sfn / /workspace/to-root")
    assert link.exit_code == 0, link.stderr

    refusals: list[tuple[str, Awaitable[Any]]] = [
        ("invalid_argument", shared.client.write_file("../escaped", b"x")),
        ("invalid_argument", shared.client.write_file("/workspace/a/../../escaped", b"x")),
        ("invalid_argument", shared.client.read_file_bytes("/etc/passwd")),
        ("permission_denied", shared.client.read_file_bytes("to-root/etc/passwd")),
        ("permission_denied", shared.client.write_file("to-root/tmp/escaped", b"x")),
        ("permission_denied", shared.client.list_files("to-root/etc")),
    ]
    for code, call in refusals:
        with pytest.raises(DaemonError) as caught:
            await call
        assert caught.value.code == code
    assert not (shared.workspace.parent / "escaped").exists()
    await shared.client.remove("to-root")


# ---------------------------------------------------------------- pause and resume


async def test_a_file_written_before_pause_is_there_after_resume(make_sandbox: Any) -> None:
    sandbox = await make_sandbox("paused-file")
    await sandbox.client.write_file("notes/kept.txt", b"written before pause")

    await sandbox.backend.pause(sandbox.handle)
    await sandbox.backend.pause(sandbox.handle)
    on_host_while_paused = (sandbox.workspace / "notes" / "kept.txt").read_bytes()
    assert await sandbox.backend.is_alive(sandbox.handle)
    await sandbox.backend.resume(sandbox.handle)
    await sandbox.backend.resume(sandbox.handle)

    assert on_host_while_paused == b"written before pause"
    assert await sandbox.client.read_file_bytes("notes/kept.txt") == b"written before pause"
    assert (await sandbox.client.run(shell="cat notes/kept.txt")).stdout == b"written before pause"


async def test_a_counter_does_not_advance_while_paused(make_sandbox: Any) -> None:
    sandbox = await make_sandbox("paused-counter")
    await sandbox.client.start_process(
        name="counter",
        argv=[
            "python3", "-c",
            "import os, time\n"
            "i = 0\n"
            "while True:\n"
            "    i += 1\n"
            "    open('counter.tmp', 'w').write(str(i)); os.replace('counter.tmp', 'counter')\n"
            "    time.sleep(0.005)\n",
        ],
    )  # fmt: skip
    counter = sandbox.workspace / "counter"

    def value() -> int:
        try:
            return int(counter.read_text() or 0)
        except (OSError, ValueError):
            return 0

    await wait_until(lambda: value() > 5, WAIT_S, what="counter runs")
    await sandbox.backend.pause(sandbox.handle)
    frozen = value()
    # Proving that nothing happens needs an observation window; 0.5 s is
    # about a hundred increments of the running counter.
    loop = asyncio.get_running_loop()
    end = loop.time() + 0.5
    while loop.time() < end:
        assert value() == frozen, "counter advanced while paused"
        await asyncio.sleep(0.02)
    await sandbox.backend.resume(sandbox.handle)
    await wait_until(lambda: value() > frozen + 5, WAIT_S, what="counter advances after resume")


# ---------------------------------------------------------------- restart of the service


async def test_sandbox_and_its_processes_survive_a_new_backend_instance(harness: Harness, make_sandbox: Any) -> None:
    sandbox = await make_sandbox("survivor")
    await sandbox.client.write_file("before-restart.txt", b"kept")
    proc = await sandbox.client.start_process(
        name="long", shell="echo before; while [ ! -e restart-go ]; do sleep 0.01; done; echo after"
    )
    await sandbox.client.close()

    restarted = harness.new_backend()
    adopted = {h.sandbox_id: h for h in await restarted.adopt()}
    assert "survivor" in adopted
    handle = adopted["survivor"]
    assert await restarted.is_alive(handle)
    async with DaemonClient(restarted.socket_path(handle)) as client:
        listed = {p.process_id: p for p in await client.list_processes()}
        assert listed[proc.process_id].running
        assert await client.read_file_bytes("before-restart.txt") == b"kept"
        await client.write_file("restart-go", b"")
        status = await client.wait_process(proc.process_id, timeout_s=20)
        chunks, _ = await collect_output(client.attach_process(proc.process_id))
    assert status is not None and status.exit_code == 0
    assert b"".join(c.data for c in chunks) == b"before\nafter\n"

    # The same sandbox again is the running one, not a replacement.
    again = await restarted.create(SandboxSpec(sandbox_id="survivor"))
    assert again.socket_path == handle.socket_path
    await restarted.destroy(handle)
    assert not await restarted.is_alive(handle)
    assert not sandbox.workspace.exists()


# ---------------------------------------------------------------- network


_CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    print(s.recv(100).decode().strip())
except OSError as exc:
    print("blocked: %r" % exc)
    sys.exit(7)
"""


def _host_ipv4_addresses() -> list[str]:
    """127.0.0.1 and every IPv4 address of this host's own interfaces."""
    return ["127.0.0.1", *[a for a in host_addresses() if ":" not in a and not a.startswith("127.")]]


@pytest.mark.parametrize("policy", ["disabled", "restricted", "enabled"])
async def test_a_sandbox_cannot_reach_a_host_listener_whatever_its_network_policy(
    make_sandbox: Any, policy: NetworkPolicy
) -> None:
    isolated = await make_sandbox(f"net-{policy}", network=policy)
    addresses = _host_ipv4_addresses()
    assert len(addresses) >= 2, addresses

    async with host_listener("0.0.0.0", b"hello from the host\n") as (port, accepted):
        for address in addresses:
            # The control: the listener answers on this address from the host.
            _, writer = await asyncio.open_connection(address, port)
            writer.close()
            blocked = await isolated.client.run(argv=["python3", "-c", _CONNECT, address, str(port)], timeout_s=20)
            assert blocked.exit_code == 7, (address, blocked.stdout)
        assert len(accepted) == len(addresses)


# ---------------------------------------------------------------- docker only


@pytest.mark.docker
async def test_docker_adopt_removes_containers_whose_data_dir_is_gone(docker_test_image: str, tmp_path: Path) -> None:
    backend = DockerBackend(Settings(data_dir=tmp_path / "data", docker_image=docker_test_image))
    handle = await backend.create(SandboxSpec(sandbox_id="orphaned"))
    kept = await backend.create(SandboxSpec(sandbox_id="kept"))
    # An operator deletes the directory (its workspace filesystem unmounted first).
    await unmount_under(Path(str(handle.private["home"])))
    shutil.rmtree(Path(str(handle.private["home"])))

    adopted = await DockerBackend(Settings(data_dir=tmp_path / "data", docker_image=docker_test_image)).adopt()

    assert [h.sandbox_id for h in adopted] == ["kept"]
    assert not await backend.is_alive(handle)
    await backend.destroy(kept)


@pytest.mark.docker
async def test_docker_create_with_a_missing_image_is_backend_unavailable(docker_engine: docker.DockerClient, tmp_path: Path) -> None:
    backend = DockerBackend(Settings(data_dir=tmp_path / "data", docker_image="berth-test-missing:none"))

    with pytest.raises(BackendUnavailable):
        await backend.create(SandboxSpec(sandbox_id="no-image"))
