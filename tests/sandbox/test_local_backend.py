"""Lifecycle of bubblewrap sandboxes: pause, restart survival, network, teardown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_support import Sandbox, SandboxFactory
from waiting import wait_until

from services.sandbox.backends.base import BackendUnavailable, SandboxSpec, SandboxStartError
from services.sandbox.backends.local import LocalBackend, detect_freezers
from services.sandbox.daemon_client import DaemonClient, DaemonError, OutputChunk

pytestmark = pytest.mark.timeout(60)

# Writes an ever-growing counter to argv[1], atomically so readers never see
# a partial value.
COUNTER = """
import itertools, os, sys, time
target = sys.argv[1]
for i in itertools.count():
    with open(target + ".tmp", "w") as f:
        f.write(str(i))
    os.replace(target + ".tmp", target)
    time.sleep(0.002)
"""


def _counter(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except FileNotFoundError:
        return -1


def _host_tree(root: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    tree = [root] if root in parents else []
    for pid in tree:
        tree.extend(child for child, parent in parents.items() if parent == pid)
    return tree


@pytest.mark.parametrize("freezer", detect_freezers())
async def test_paused_sandbox_keeps_files_and_freezes_processes_until_resumed(
    make_sandbox: SandboxFactory, tmp_path: Path, freezer: str
) -> None:
    sandbox = await make_sandbox(freezer=freezer)
    assert sandbox.handle.private["freezer"] == freezer
    await sandbox.client.start_process(name="counter", argv=["python3", "-c", COUNTER, "/workspace/counter"])
    counter = sandbox.workspace / "counter"
    await wait_until(lambda: _counter(counter) > 5)

    await sandbox.client.write_file("before_pause.txt", b"written just before the pause")
    await sandbox.backend.pause(sandbox.handle)
    frozen_at = _counter(counter)

    assert (sandbox.workspace / "before_pause.txt").read_bytes() == b"written just before the pause"
    # The same loop outside the sandbox measures out a window in which the
    # frozen one would have advanced many times.
    reference = tmp_path / "reference"
    twin = await asyncio.create_subprocess_exec(sys.executable, "-c", COUNTER, str(reference))
    try:
        await wait_until(lambda: _counter(reference) >= 25, what="reference counter advanced")
    finally:
        twin.kill()
        await twin.wait()
    assert _counter(counter) == frozen_at

    await sandbox.backend.resume(sandbox.handle)
    await sandbox.backend.resume(sandbox.handle)

    await wait_until(lambda: _counter(counter) > frozen_at + 5, what="counter advanced after resume")
    assert await sandbox.client.read_file_bytes("before_pause.txt") == b"written just before the pause"


def _sectors_written(mount_point: Path) -> int:
    """Sectors written so far to the block device mounted at ``mount_point``
    (its most recent mount)."""
    target = os.path.realpath(mount_point)
    device = ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == target:
            device = fields[2]
    assert device, f"nothing is mounted at {target}"
    return int(Path(f"/sys/dev/block/{device}/stat").read_text().split()[6])


async def test_pausing_a_sandbox_writes_back_its_own_workspace_and_no_other_filesystem_of_the_host(
    make_sandbox: SandboxFactory, tmp_path: Path
) -> None:
    sandbox = await make_sandbox()
    # Another tenant's filesystem, as the host has many: an ext4 image of its own.
    image, other = tmp_path / "other.ext4", tmp_path / "other"
    other.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(other)], check=True, capture_output=True)
    try:
        # 8 MiB in each, left in the page cache (nothing fsyncs them).
        (other / "unsynced").write_bytes(os.urandom(8 << 20))
        result = await sandbox.client.run(shell="head -c 8388608 /dev/urandom > /workspace/unsynced")
        assert result.exit_code == 0
        own_before, other_before = _sectors_written(sandbox.workspace), _sectors_written(other)
        await sandbox.backend.pause(sandbox.handle)
        own_after, other_after = _sectors_written(sandbox.workspace), _sectors_written(other)
        await sandbox.backend.resume(sandbox.handle)
    finally:
        subprocess.run(["umount", str(other)], check=True, capture_output=True)
    # The sandbox's own writes reached its disk before it froze ...
    assert own_after - own_before >= (8 << 20) // 512
    # ... and the pause did not write back the host's other filesystems (sync(2) would have).
    assert other_after - other_before < (8 << 20) // 512 // 8


async def test_sandbox_survives_a_service_restart_and_is_adopted(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first_backend = LocalBackend(data_dir, "bwrap")
    handle = await first_backend.create(SandboxSpec(sandbox_id="keep"))
    first_client = DaemonClient(first_backend.socket_path(handle))
    proc = await first_client.start_process(
        name="waiter", shell="echo before restart; while [ ! -e go ]; do sleep 0.01; done; echo after restart"
    )
    first_output = await anext(first_client.attach_process(proc.process_id))
    assert isinstance(first_output, OutputChunk)
    await first_client.close()
    del first_backend, first_client
    gc.collect()

    second_backend = LocalBackend(data_dir, "bwrap")
    try:
        adopted = await second_backend.adopt()
        assert [h.sandbox_id for h in adopted] == ["keep"]
        assert adopted[0].private["pid"] == handle.private["pid"]
        async with DaemonClient(second_backend.socket_path(adopted[0])) as client:
            listed = {p.process_id: p for p in await client.list_processes()}
            assert listed[proc.process_id].running
            await client.write_file("go", b"")
            output = b""
            async for item in client.attach_process(proc.process_id):
                if isinstance(item, OutputChunk):
                    output += item.data
        assert output == b"before restart\nafter restart\n"
    finally:
        await second_backend.destroy(handle)


@pytest.mark.parametrize("network", ["disabled", "enabled", "restricted"])
async def test_host_loopback_is_unreachable_whatever_the_network_policy(make_sandbox: SandboxFactory, network: str) -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sandbox = await make_sandbox(network=network)
        probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
        result = await sandbox.client.run(argv=["python3", "-c", probe])
    finally:
        server.close()
        await server.wait_closed()

    assert result.exit_code != 0, result.stderr


async def test_unconfined_sandbox_runs_commands_on_the_host_with_paths_still_confined(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(isolation="none", env={"DATA": "/workspace/data"})
    root = str(sandbox.workspace)

    await sandbox.client.write_file("/workspace/data/hello.txt", b"hi")
    result = await sandbox.client.run(shell='pwd; echo "$HOME|$BERTH_WORKSPACE|$DATA"; cat "$DATA/hello.txt"', cwd="/workspace/data")
    with pytest.raises(DaemonError) as traversal:
        await sandbox.client.read_file_bytes("../../../etc/passwd")

    assert sandbox.client.hello["isolation"] == "none"
    assert result.stdout.decode() == f"{root}/data\n{root}|{root}|{root}/data\nhi"
    assert (sandbox.workspace / "data" / "hello.txt").read_bytes() == b"hi"
    assert traversal.value.code == "invalid_argument"


async def test_daemon_refuses_an_unsupported_protocol_version(sandbox: Sandbox) -> None:
    reader, writer = await asyncio.open_unix_connection(sandbox.handle.socket_path)
    body = json.dumps({"op": "hello", "v": 2}).encode()
    writer.write(struct.pack(">I", len(body)) + body)
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    answer = json.loads(await reader.readexactly(length))
    closed = await reader.read()
    writer.close()

    assert answer["ok"] is False
    assert answer["error"]["code"] == "failed_precondition"
    assert closed == b""
    assert (await sandbox.client.ping())["ok"] is True


async def test_destroy_stops_every_process_and_deletes_the_sandbox(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox()
    await sandbox.client.start_process(name="escapee", shell="( setsid sleep 600 & ); sleep 600")
    pid = int(sandbox.handle.private["pid"])
    await wait_until(lambda: len(_host_tree(pid)) >= 4, what="sandbox processes started")
    members = _host_tree(pid)
    cgroup_dirs = list(sandbox.handle.private["cgroups"]["dirs"].values())

    await sandbox.backend.destroy(sandbox.handle)

    assert not await sandbox.backend.is_alive(sandbox.handle)
    assert [p for p in members if Path(f"/proc/{p}").exists() and _host_tree(p)] == []
    assert not Path(str(sandbox.handle.private["home"])).exists()
    assert cgroup_dirs and [d for d in cgroup_dirs if Path(d).exists()] == []
    assert not os.path.ismount(str(sandbox.handle.private["workspace_dir"]))


async def test_recreating_a_dead_sandbox_keeps_its_workspace(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("phoenix")
    await sandbox.client.write_file("keep.txt", b"still here")
    for pid in _host_tree(int(sandbox.handle.private["pid"])):
        os.kill(pid, signal.SIGKILL)
    await wait_until(lambda: _alive_is(sandbox, False))

    handle = await sandbox.backend.create(SandboxSpec(sandbox_id="phoenix"))
    async with DaemonClient(handle.socket_path) as client:
        content = await client.read_file_bytes("keep.txt")

    assert handle.private["pid"] != sandbox.handle.private["pid"]
    assert content == b"still here"
    sandbox.handle = handle


async def _alive_is(sandbox: Sandbox, expected: bool) -> bool:
    return bool(await sandbox.backend.is_alive(sandbox.handle) == expected)


async def test_creating_a_sandbox_is_idempotent_while_it_runs(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("same")

    again = await sandbox.backend.create(SandboxSpec(sandbox_id="same"))

    assert again == sandbox.handle


async def test_missing_bubblewrap_is_reported_as_backend_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    backend = LocalBackend(tmp_path / "data", "bwrap")

    with pytest.raises(BackendUnavailable, match="BERTH_SANDBOX_ISOLATION=none"):
        await backend.create(SandboxSpec(sandbox_id="nobwrap"))


async def test_a_sandbox_whose_bubblewrap_fails_before_its_namespaces_exist_fails_to_start_and_can_start_again(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    backend = LocalBackend(tmp_path / "data", "bwrap", extra_ro_mounts={site: "/opt/site"})
    site.rmdir()  # checked when the backend was made; bwrap's staging now fails

    with pytest.raises(SandboxStartError):
        await backend.create(SandboxSpec(sandbox_id="early"))

    site.mkdir()
    handle = await backend.create(SandboxSpec(sandbox_id="early"))
    try:
        async with DaemonClient(backend.socket_path(handle)) as client:
            assert [ev.exit_code async for ev in client.exec(argv=["true"]) if not isinstance(ev, OutputChunk)] == [0]
    finally:
        await backend.destroy(handle)


# A process whose children are started by the main thread and by a second,
# still running thread (each task lists only the children it forked while
# it lives), one of them with a child of its own.
_FORKING_TREE = """
import subprocess, threading, time
kids = [subprocess.Popen(["sh", "-c", "sleep 30 & wait"])]
spawned = threading.Event()
def helper():
    kids.append(subprocess.Popen(["sleep", "30"]))
    spawned.set()
    time.sleep(30)
threading.Thread(target=helper, daemon=True).start()
spawned.wait()
time.sleep(0.2)
print("ready", flush=True)
time.sleep(30)
"""


async def test_a_process_tree_is_found_whole_by_walking_down_from_its_root() -> None:
    from services.sandbox.backends.local import _process_tree, _scanned_tree

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _FORKING_TREE, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"ready\n"
        walked = _process_tree(proc.pid)
        # root, sh and its sleep (main thread's), the helper thread's sleep
        assert len(walked) == 4 and walked[0] == proc.pid, walked
        assert sorted(walked) == sorted(_scanned_tree(proc.pid))
    finally:
        tree = _scanned_tree(proc.pid)
        for pid in reversed(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await proc.wait()
    assert _process_tree(proc.pid) == []
