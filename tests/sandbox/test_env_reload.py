"""sandboxd's ``env.reload``: a running daemon takes up a rewritten env file
(how a docker pool container learns the environment of its sandbox)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sandbox_support import Sandbox, SandboxFactory

from services.sandbox.daemon_client import DaemonError, OutputChunk


def _env_file(sandbox: Sandbox) -> Path:
    return Path(sandbox.client.socket_path).parent / "env.json"


async def test_env_reload_gives_later_commands_the_rewritten_environment(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(env={"STAGE": "before"})
    earlier = await sandbox.client.start_process(name="earlier", shell='while [ ! -e go ]; do sleep 0.01; done; echo "$STAGE"')
    _env_file(sandbox).write_text(json.dumps({"STAGE": "after", "ADDED": "yes"}))

    assert await sandbox.client.reload_env() == 2

    result = await sandbox.client.run(shell='echo "$STAGE $ADDED"')
    assert result.stdout == b"after yes\n"
    # A command that was already running keeps the environment it started with.
    await sandbox.client.write_file("go", b"")
    status = await sandbox.client.wait_process(earlier.process_id, timeout_s=20)
    assert status is not None and status.exit_code == 0
    output = [item.data async for item in sandbox.client.attach_process(earlier.process_id) if isinstance(item, OutputChunk)]
    assert b"".join(output) == b"before\n"


async def test_env_reload_of_a_malformed_file_fails_and_keeps_the_environment(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(env={"STAGE": "before"})
    _env_file(sandbox).write_text("[1, 2]")

    with pytest.raises(DaemonError) as failed:
        await sandbox.client.reload_env()

    assert failed.value.code == "failed_precondition"
    result = await sandbox.client.run(shell='echo "$STAGE"')
    assert result.stdout == b"before\n"
