"""Background processes in sandboxd: reattach, survival, kill, exit codes."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from sandbox_support import Sandbox, collect_output
from waiting import wait_until

from services.sandbox.daemon_client import DaemonClient, DaemonError, OutputChunk

pytestmark = pytest.mark.timeout(60)

# Prints numbered lines well past the 1 MiB ring, waits for /workspace/go,
# prints a few more and exits.
FIRST_LINES = 200_000
LAST_LINE = FIRST_LINES + 100
NUMBERED_LINES = f"""
import os, sys, time
out = sys.stdout
for i in range({FIRST_LINES}):
    out.write("%08d\\n" % i)
out.flush()
while not os.path.exists("/workspace/go"):
    time.sleep(0.01)
for i in range({FIRST_LINES}, {LAST_LINE}):
    out.write("%08d\\n" % i)
out.flush()
"""


def _read_log(path: Path) -> list[tuple[int, int, bytes]]:
    """Parses the documented on-disk record format."""
    header = struct.Struct(">QBI")
    data = path.read_bytes()
    records = []
    offset = 0
    while offset < len(data):
        seq, stream, length = header.unpack_from(data, offset)
        offset += header.size
        records.append((seq, stream, data[offset : offset + length]))
        offset += length
    return records


def _host_pids_with_marker(process_id: str) -> list[int]:
    needle = f"\0BERTH_PROCESS_ID={process_id}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in b"\0" + environ and state != "Z":
                found.append(int(entry))
    return found


async def test_reattaching_after_a_disconnect_loses_no_output(sandbox: Sandbox) -> None:
    first_client = DaemonClient(sandbox.handle.socket_path)
    proc = await first_client.start_process(name="numbers", argv=["python3", "-c", NUMBERED_LINES])
    early = first_client.attach_process(proc.process_id)
    seen = [await anext(early) for _ in range(3)]
    assert all(isinstance(item, OutputChunk) for item in seen)
    await first_client.close()

    second_client = DaemonClient(sandbox.handle.socket_path)
    await second_client.write_file("go", b"")
    chunks, status = await collect_output(second_client.attach_process(proc.process_id, from_seq=0))

    assert status is not None and status.exit_code == 0
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert b"".join(c.data for c in chunks) == b"".join(b"%08d\n" % i for i in range(LAST_LINE))
    assert chunks[:3] == seen

    later = len(chunks) // 2
    tail, _ = await collect_output(second_client.attach_process(proc.process_id, from_seq=later))
    assert tail == chunks[later:]

    # The first megabyte left the ring, so it was replayed from the log.
    # The log lives on a tmpfs in the sandbox's own mount namespace.
    inner = int(sandbox.handle.private["inner_pid"])
    log_path = Path(f"/proc/{inner}/root/run/berth/state/procs/{proc.process_id}.log")
    assert log_path.stat().st_size > 1024 * 1024
    assert [(seq, data) for seq, _, data in _read_log(log_path)] == [(c.seq, c.data) for c in chunks]
    await second_client.close()


async def test_background_process_survives_the_connection_that_started_it(sandbox: Sandbox) -> None:
    starter = DaemonClient(sandbox.handle.socket_path)
    proc = await starter.start_process(
        name="ticker", shell="i=0; while :; do i=$((i+1)); echo $i > tick.tmp; mv tick.tmp tick; sleep 0.01; done"
    )
    await starter.close()
    tick = sandbox.workspace / "tick"
    await wait_until(tick.exists)
    after_close = int(tick.read_text())

    await wait_until(lambda: int(tick.read_text() or 0) > after_close + 3, what="ticker kept running")
    listed = {p.process_id: p for p in await sandbox.client.list_processes()}
    assert listed[proc.process_id].running
    assert listed[proc.process_id].name == "ticker"
    await sandbox.client.kill_process(proc.process_id)


async def test_killing_a_process_leaves_no_descendant_alive(sandbox: Sandbox) -> None:
    script = """
sleep 600 & echo $! > group_child.pid
setsid sh -c 'echo $$ > session_child.pid; exec sleep 600' &
( setsid sh -c 'echo $$ > orphan.pid; exec sleep 600' & )
wait
"""
    proc = await sandbox.client.start_process(name="tree", shell=script)
    pid_files = [sandbox.workspace / name for name in ("group_child.pid", "session_child.pid", "orphan.pid")]
    await wait_until(lambda: all(f.exists() and f.read_text().strip() for f in pid_files))
    assert len(_host_pids_with_marker(proc.process_id)) >= 4

    after = await sandbox.client.kill_process(proc.process_id)

    assert after is not None and not after.running and after.exit_code == -9
    await wait_until(lambda: not _host_pids_with_marker(proc.process_id), what="every member of the tree is gone")
    for pid_file in pid_files:
        pid = pid_file.read_text().strip()
        check = await sandbox.client.run(shell=f"test -e /proc/{pid}")
        assert check.exit_code != 0, f"{pid_file.name} pid {pid} survived"


async def test_exit_codes_are_kept_after_a_process_exits(sandbox: Sandbox) -> None:
    quick = await sandbox.client.start_process(name="quick", shell="echo bye; exit 3")
    slow = await sandbox.client.start_process(name="slow", argv=["sleep", "600"])

    status = await sandbox.client.wait_process(quick.process_id, timeout_s=10)
    still_running = await sandbox.client.wait_process(slow.process_id, timeout_s=0.1)
    listed = {p.process_id: p for p in await sandbox.client.list_processes()}
    replay, final = await collect_output(sandbox.client.attach_process(quick.process_id))

    assert status is not None and status.exit_code == 3
    assert still_running is None
    assert (listed[quick.process_id].running, listed[quick.process_id].exit_code) == (False, 3)
    assert listed[slow.process_id].running
    assert b"".join(c.data for c in replay) == b"bye\n" and final == status
    await sandbox.client.kill_process(slow.process_id)


ECHO_LINES = "import sys\nfor line in sys.stdin:\n    print('got ' + line.strip(), flush=True)\nprint('eof', flush=True)\n"


async def test_a_process_started_with_stdin_reads_what_is_written_and_sees_eof_on_close(sandbox: Sandbox) -> None:
    proc = await sandbox.client.start_process(name="echo", argv=["python3", "-c", ECHO_LINES], stdin=True)
    assert proc.stdin_open

    await sandbox.client.write_stdin(proc.process_id, b"one\n")
    stream = sandbox.client.attach_process(proc.process_id)
    first = await anext(stream)
    await stream.aclose()
    after = await sandbox.client.write_stdin(proc.process_id, b"two\n", close=True)
    status = await sandbox.client.wait_process(proc.process_id, timeout_s=10)
    chunks, final = await collect_output(sandbox.client.attach_process(proc.process_id))

    assert isinstance(first, OutputChunk) and first.data == b"got one\n"
    assert not after.stdin_open
    assert status is not None and status.exit_code == 0 and final == status
    assert b"".join(c.data for c in chunks) == b"got one\ngot two\neof\n"


async def test_writing_stdin_is_refused_without_a_pipe_or_after_close(sandbox: Sandbox) -> None:
    plain = await sandbox.client.start_process(name="plain", argv=["sleep", "600"])
    piped = await sandbox.client.start_process(name="piped", argv=["sleep", "600"], stdin=True)
    await sandbox.client.write_stdin(piped.process_id, b"", close=True)

    for process_id in (plain.process_id, piped.process_id):
        with pytest.raises(DaemonError) as refused:
            await sandbox.client.write_stdin(process_id, b"x\n")
        assert refused.value.code == "failed_precondition"
    with pytest.raises(DaemonError) as unknown:
        await sandbox.client.write_stdin("proc_unknown", b"x\n")
    assert unknown.value.code == "not_found"
    for process_id in (plain.process_id, piped.process_id):
        await sandbox.client.kill_process(process_id)


async def test_a_start_by_name_returns_the_process_of_that_name_instead_of_running_it_again(sandbox: Sandbox) -> None:
    first = await sandbox.client.start_process(name="exec-item_1", shell="echo once >> /workspace/runs; sleep 600", by_name=True)
    again = await sandbox.client.start_process(name="exec-item_1", shell="echo once >> /workspace/runs; sleep 600", by_name=True)
    other = await sandbox.client.start_process(name="exec-item_2", shell="true", by_name=True)
    plain = await sandbox.client.start_process(name="exec-item_1", shell="true")

    assert again.process_id == first.process_id and again.running
    assert len({first.process_id, other.process_id, plain.process_id}) == 3
    await wait_until(lambda: (sandbox.workspace / "runs").exists(), timeout=10, what="the first start to run")
    with pytest.raises(DaemonError) as nameless:
        await sandbox.client.start_process(shell="true", by_name=True)
    assert nameless.value.code == "invalid_argument"
    assert (sandbox.workspace / "runs").read_text() == "once\n"
    await sandbox.client.kill_process(first.process_id)
