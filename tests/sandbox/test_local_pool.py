"""The local backend's warm pool: sandboxes started ahead per (size,
network), each claimed once, by a claimant of the same size and network
only, and fresh: nothing of another claimant's files, processes or
environment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from waiting import wait_until

from services.sandbox.backends.base import BackendHandle, SandboxSpec
from services.sandbox.backends.local import LocalBackend
from services.sandbox.daemon_client import DaemonClient
from services.sandbox.isolation.sizes import SIZES


@pytest.fixture
async def pooled_backend(tmp_path: Path) -> AsyncIterator[tuple[LocalBackend, list[BackendHandle]]]:
    backend = LocalBackend(tmp_path / "data", "bwrap", pool_size=1, dormant_after_s=30)
    await backend.start()
    created: list[BackendHandle] = []
    try:
        yield backend, created
    finally:
        for handle in created:
            await backend.destroy(handle)
        await backend.close()
    assert not any((tmp_path / "data" / "pool").iterdir()), "close() leaves no pooled sandbox behind"


async def _shell(backend: LocalBackend, handle: BackendHandle, script: str) -> bytes:
    async with DaemonClient(backend.socket_path(handle)) as client:
        result = await client.run(shell=script)
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def test_each_claimed_sandbox_comes_fresh_from_the_pool(pooled_backend: tuple[LocalBackend, list[BackendHandle]]) -> None:
    backend, created = pooled_backend
    first = await backend.create(SandboxSpec(sandbox_id="first", env={"FIRST_SECRET": "one"}))
    created.append(first)
    await _shell(backend, first, "echo private > /workspace/mine.txt; echo tmp > /tmp/mine.txt; (sleep 600 &)")
    for claimant, env in (("second", {"SECOND_VAR": "two"}), ("third", {"THIRD_VAR": "three"})):
        await wait_until(lambda: backend.pool_ready("medium", "disabled") == 1, 60, what="the pool refills")
        handle = await backend.create(SandboxSpec(sandbox_id=claimant, env=env, labels={"who": claimant}))
        created.append(handle)

        assert handle.private.get("pool_slot"), "the sandbox came from the pool"
        assert handle.private["labels"] == {"who": claimant}
        seen = await _shell(backend, handle, "env; echo ---; ls -A /workspace /tmp; echo ---; cat /proc/[0-9]*/comm")
        variables, listing, processes = seen.split(b"---\n")
        assert f"{next(iter(env))}={next(iter(env.values()))}".encode() in variables
        for other in (b"FIRST_SECRET", b"SECOND_VAR", b"THIRD_VAR"):
            if other.decode() not in env:
                assert other not in variables
        assert b"mine.txt" not in listing
        # No process of another claimant (the first left a sleep running).
        assert b"sleep" not in processes
        await _shell(backend, handle, f"echo {claimant} > /workspace/mine.txt")
    # Each claimant keeps its own workspace under its own sandbox ID.
    assert Path(str(created[1].private["workspace_dir"])).name == "workspace"
    assert (Path(str(created[1].private["workspace_dir"])) / "mine.txt").read_text() == "second\n"


async def test_pooled_sandbox_serves_only_a_claimant_of_its_size_and_network(
    pooled_backend: tuple[LocalBackend, list[BackendHandle]],
) -> None:
    backend, created = pooled_backend
    created.append(await backend.create(SandboxSpec(sandbox_id="warmup")))
    await wait_until(lambda: backend.pool_ready("medium", "disabled") == 1, 60, what="the pool fills")

    other_network = await backend.create(SandboxSpec(sandbox_id="online", network="enabled"))
    created.append(other_network)
    other_size = await backend.create(SandboxSpec(sandbox_id="small", size=SIZES["small"]))
    created.append(other_size)

    assert "pool_slot" not in other_network.private
    assert "pool_slot" not in other_size.private
    assert backend.pool_ready("medium", "disabled") == 1
    matching = await backend.create(SandboxSpec(sandbox_id="matching"))
    created.append(matching)
    assert matching.private.get("pool_slot")
