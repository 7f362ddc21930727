"""exec through sandboxd in a bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from sandbox_support import Sandbox
from waiting import wait_until

from services.sandbox.daemon_client import DaemonClient, ExitStatus, OutputChunk

pytestmark = pytest.mark.timeout(60)


async def _pid_gone(client: Any, pid: int) -> bool:
    """Gone means absent from the sandbox's /proc or a zombie."""
    result = await client.run(shell=f"test -e /proc/{pid}/stat && ! grep -q '^{pid} ([^)]*) Z' /proc/{pid}/stat")
    return bool(result.exit_code != 0)


async def test_exec_reports_exit_codes_and_keeps_stderr_separate(sandbox: Sandbox) -> None:
    ok = await sandbox.client.run(argv=["true"])
    failed = await sandbox.client.run(shell="echo out; echo err >&2; exit 7")
    signalled = await sandbox.client.run(shell="kill -TERM $$")
    missing = await sandbox.client.run(argv=["/no/such/command"])

    assert (ok.exit_code, ok.timed_out) == (0, False)
    assert (failed.exit_code, failed.stdout, failed.stderr) == (7, b"out\n", b"err\n")
    assert signalled.exit_code == -15
    assert missing.exit_code == 127


async def test_exec_passes_cwd_env_and_stdin(sandbox: Sandbox) -> None:
    await sandbox.client.mkdir("/workspace/sub")
    result = await sandbox.client.run(
        shell='pwd; echo "$GREETING $HOME"; cat', cwd="/workspace/sub", env={"GREETING": "hello"}, stdin=b"from stdin"
    )

    assert result.stdout == b"/workspace/sub\nhello /workspace\nfrom stdin"


async def test_exec_streams_ten_mebibytes_without_deadlock(sandbox: Sandbox) -> None:
    size = 10 * 1024 * 1024
    counts = {"stdout": 0, "stderr": 0}
    seqs: list[int] = []
    status: ExitStatus | None = None

    async for item in sandbox.client.exec(shell=f"head -c {size} /dev/zero & head -c {size} /dev/zero >&2; wait"):
        if isinstance(item, OutputChunk):
            counts[item.stream] += len(item.data)
            seqs.append(item.seq)
        else:
            status = item

    assert status is not None and status.exit_code == 0
    assert counts == {"stdout": size, "stderr": size}
    assert seqs == list(range(len(seqs)))


async def test_hung_exec_does_not_block_another_exec_on_the_same_connection(sandbox: Sandbox) -> None:
    hung = asyncio.create_task(sandbox.client.run(argv=["sleep", "600"]))
    try:
        quick = await asyncio.wait_for(sandbox.client.run(argv=["echo", "still served"]), timeout=5)
        assert quick.stdout == b"still served\n"
        assert not hung.done()
    finally:
        hung.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hung


async def test_cancelling_an_exec_kills_its_process_group(sandbox: Sandbox) -> None:
    stream = sandbox.client.exec(shell="sleep 600 & echo $!; wait")
    first = await anext(stream)
    assert isinstance(first, OutputChunk)
    child = int(first.data.split()[0])

    await stream.aclose()

    await wait_until(lambda: _pid_gone(sandbox.client, child))


async def test_exec_timeout_kills_the_process_group_and_reports_timed_out(sandbox: Sandbox) -> None:
    result = await sandbox.client.run(shell="sleep 600 & echo $!; wait", timeout_s=0.5)
    child = int(result.stdout.split()[0])

    assert (result.exit_code, result.timed_out) == (124, True)
    await wait_until(lambda: _pid_gone(sandbox.client, child))


async def test_warm_exec_reuses_one_connection(sandbox: Sandbox) -> None:
    loop = asyncio.get_running_loop()
    await sandbox.client.run(argv=["true"])
    started = loop.time()
    for _ in range(20):
        await sandbox.client.run(argv=["true"])
    per_exec = (loop.time() - started) / 20

    # A reconnect or a fresh bwrap per call would cost tens of milliseconds.
    assert per_exec < 0.05


async def test_closing_the_connection_kills_a_running_exec(sandbox: Sandbox) -> None:
    other = DaemonClient(sandbox.handle.socket_path)
    stream = other.exec(shell="sleep 600 & echo $!; wait")
    first = await anext(stream)
    assert isinstance(first, OutputChunk)
    child = int(first.data.split()[0])

    await other.close()

    await wait_until(lambda: _pid_gone(sandbox.client, child))
