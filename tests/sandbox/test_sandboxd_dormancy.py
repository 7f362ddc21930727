"""sandboxd's dormancy: an idle daemon becomes a bare interpreter holding
its socket and connections, and becomes the whole daemon again on the next
request, with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from sandbox_support import Sandbox, SandboxFactory
from waiting import wait_until

from services.sandbox.backends.base import SandboxSpec
from services.sandbox.backends.local import LocalBackend, _process_tree
from services.sandbox.daemon_client import DaemonClient

_IDLE_S = 0.2


def _daemon_command(sandbox: Sandbox) -> list[str]:
    for pid in _process_tree(int(sandbox.handle.private["pid"])):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().decode().split("\0")
        except OSError:
            continue
        if "python" in argv[0].rsplit("/", 1)[-1]:
            return argv
    return []


def _dormant(sandbox: Sandbox) -> bool:
    # Gone dormant, or started so and not woken yet.
    return not {"--dormant", "--start-dormant"}.isdisjoint(_daemon_command(sandbox))


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_idle_daemon_goes_dormant_and_its_next_command_runs_on_the_same_connection(
    make_sandbox: SandboxFactory, isolation: str
) -> None:
    sandbox = await make_sandbox(isolation=isolation, dormant_after_s=_IDLE_S, env={"GREETING": "hello"})
    await sandbox.client.write_file("kept.txt", b"written before")
    daemon_pid = (await sandbox.client.ping())["pid"]

    await wait_until(lambda: _dormant(sandbox), 30, what="the idle daemon goes dormant")

    result = await sandbox.client.run(shell='echo "$GREETING"; cat kept.txt')
    assert result.exit_code == 0
    assert result.stdout == b"hello\nwritten before"
    assert not _dormant(sandbox)
    # The same process (PID 1 of the sandbox) woke up; nothing was restarted.
    assert (await sandbox.client.ping())["pid"] == daemon_pid


async def test_sandbox_with_an_idle_period_starts_dormant_and_its_first_connection_wakes_it(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "data", "bwrap", dormant_after_s=600)
    handle = await backend.create(SandboxSpec(sandbox_id="untouched", env={"GREETING": "first"}))
    try:
        started = Sandbox(backend, handle, DaemonClient(backend.socket_path(handle)))
        assert _dormant(started)

        result = await started.client.run(shell='echo "$GREETING"')
        assert result.stdout == b"first\n"
        assert not _dormant(started)
        await started.client.close()
    finally:
        await backend.destroy(handle)


async def test_dormant_daemon_wakes_for_a_new_connection(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox(dormant_after_s=_IDLE_S)
    await sandbox.client.close()
    await wait_until(lambda: _dormant(sandbox), 30, what="the idle daemon goes dormant")

    async with DaemonClient(sandbox.backend.socket_path(sandbox.handle)) as client:
        result = await client.run(argv=["echo", "awake"])
    assert result.stdout == b"awake\n"


async def test_daemon_stays_whole_while_a_background_process_or_its_record_exists(make_sandbox: SandboxFactory) -> None:
    busy = await make_sandbox("busy", dormant_after_s=_IDLE_S)
    control = await make_sandbox("control", dormant_after_s=_IDLE_S)
    running = await busy.client.start_process(name="sleeper", shell="sleep 600")
    finished = await busy.client.start_process(name="quick", argv=["true"])
    status = await busy.client.wait_process(finished.process_id, timeout_s=20)
    assert status is not None and status.exit_code == 0

    # The control sandbox shows that the idle period has passed.
    await wait_until(lambda: _dormant(control), 30, what="the idle control daemon goes dormant")
    assert not _dormant(busy)
    listed = {p.process_id for p in await busy.client.list_processes()}
    assert {running.process_id, finished.process_id} <= listed
