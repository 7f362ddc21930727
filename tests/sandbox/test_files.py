"""File operations in sandboxd, confined to the workspace."""

from __future__ import annotations

import os
from typing import Any

import pytest
from sandbox_support import Sandbox

from services.sandbox.daemon_client import DaemonError

pytestmark = pytest.mark.timeout(60)


async def test_files_round_trip_through_write_read_stat_list_and_remove(sandbox: Sandbox) -> None:
    client = sandbox.client
    size = await client.write_file("/workspace/notes/today.txt", b"first\n", mode=0o600)
    appended = await client.write_file("notes/today.txt", b"second\n", append=True)
    await client.mkdir("notes/empty")

    assert (size, appended) == (6, 13)
    assert await client.read_file_bytes("notes/today.txt") == b"first\nsecond\n"
    assert (sandbox.workspace / "notes" / "today.txt").read_bytes() == b"first\nsecond\n"
    entry = await client.stat("/workspace/notes/today.txt")
    assert (entry.path, entry.type, entry.size, entry.mode) == ("/workspace/notes/today.txt", "file", 13, 0o600)
    listed = await client.list_files("/workspace", recursive=True)
    assert {(e.path, e.type) for e in listed} == {
        ("/workspace/notes", "dir"),
        ("/workspace/notes/today.txt", "file"),
        ("/workspace/notes/empty", "dir"),
    }

    with pytest.raises(DaemonError) as not_empty:
        await client.remove("notes")
    await client.remove("notes", recursive=True)
    with pytest.raises(DaemonError) as missing:
        await client.read_file_bytes("notes/today.txt")

    assert not_empty.value.code == "failed_precondition"
    assert missing.value.code == "not_found"
    assert await client.list_files() == []


async def test_overwriting_a_file_is_atomic_and_leaves_no_temporary_files(sandbox: Sandbox) -> None:
    await sandbox.client.write_file("data.bin", b"old" * 1000)
    await sandbox.client.write_file("data.bin", b"new")

    assert os.listdir(sandbox.workspace) == ["data.bin"]
    assert (sandbox.workspace / "data.bin").read_bytes() == b"new"


async def test_large_files_stream_in_chunks_of_at_most_one_mebibyte(sandbox: Sandbox) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    await sandbox.client.write_file("big.bin", payload)

    chunks = [chunk async for chunk in sandbox.client.read_file("big.bin")]
    window = b"".join([chunk async for chunk in sandbox.client.read_file("big.bin", offset=1000, length=5000)])

    assert b"".join(chunks) == payload
    assert max(len(c) for c in chunks) <= 1024 * 1024
    assert window == payload[1000:6000]


@pytest.mark.parametrize("path", ["../../etc/passwd", "/workspace/../etc/passwd", "a/../../etc/passwd", "/etc/passwd"])
async def test_paths_outside_the_workspace_are_invalid_arguments(sandbox: Sandbox, path: str) -> None:
    with pytest.raises(DaemonError) as read_error:
        await sandbox.client.read_file_bytes(path)
    with pytest.raises(DaemonError) as write_error:
        await sandbox.client.write_file(path, b"owned")

    assert read_error.value.code == "invalid_argument"
    assert write_error.value.code == "invalid_argument"


async def test_symlinks_leaving_the_workspace_are_permission_denied(sandbox: Sandbox) -> None:
    client = sandbox.client
    await client.write_file("inside.txt", b"fine")
    made = await client.run(shell="ln -s /etc etc_link && ln -s /etc/passwd passwd_link && ln -s inside.txt ok_link")
    assert made.exit_code == 0

    refused = []
    for attempt in (
        client.read_file_bytes("etc_link/passwd"),
        client.read_file_bytes("passwd_link"),
        client.write_file("etc_link/evil", b"x"),
        client.write_file("passwd_link", b"x", append=True),
        client.list_files("etc_link"),
    ):
        with pytest.raises(DaemonError) as error:
            await attempt
        refused.append(error.value.code)

    assert refused == ["permission_denied"] * 5
    assert await client.read_file_bytes("ok_link") == b"fine"
    assert (await client.stat("passwd_link")).type == "symlink"
    await client.remove("passwd_link")
    assert os.path.exists("/etc/passwd")


async def test_trees_deeper_than_the_interpreters_recursion_limit_are_written_and_removed(sandbox: Any) -> None:
    # os.makedirs and shutil.rmtree take a stack frame per level.
    deep = "/workspace/" + "d/" * 1200 + "leaf.txt"

    await sandbox.client.write_file(deep, b"x")
    await sandbox.client.mkdir("/workspace/" + "m/" * 1200)
    assert (sandbox.workspace / deep.removeprefix("/workspace/")).read_bytes() == b"x"
    await sandbox.client.remove("/workspace/d", recursive=True)
    await sandbox.client.remove("/workspace/m", recursive=True)

    assert await sandbox.client.list_files() == []
