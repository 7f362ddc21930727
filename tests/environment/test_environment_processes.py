"""Background processes: the Environment service's process RPCs over the
real Sandbox service (bubblewrap), and the Session service's environment
port that reaches them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from environment_helpers import Cluster, SandboxService, create_env, md, run_command
from grpc_support import credentials
from waiting import wait_until

from berth.environment.v1 import environment_service_pb2 as pb
from services.core import errors
from services.core.context import org_id_var
from services.core.db import open_database
from services.core.settings import Settings
from services.session.environment_client import EnvironmentClient
from services.session.harness.environment import CommandExit, CommandOutput
from services.session.store import Store
from services.session.turn_environment import TurnEnvironment
from services.session.turn_writer import TurnWriter

_SESSION_MIGRATIONS = Path(str(__import__("services.session.server", fromlist=["x"]).__file__)).parent / "migrations" / "versions"


async def test_a_background_process_outlives_its_call_and_is_listed_followed_and_killed(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_owner")).environment
    started = await service.stub.StartProcess(
        pb.StartProcessRequest(
            environment_id=env.id,
            session_id="sess_owner",
            name="server",
            shell='echo "out=$REBYTE_OUTPUT_DIR"; exec sleep 317',
        ),
        metadata=md(),
    )
    process_id = started.process.process_id
    assert started.process.running and started.process.name == "server"

    listed = await service.stub.ListProcesses(pb.ListProcessesRequest(environment_id=env.id), metadata=md())
    assert [p.process_id for p in listed.processes if p.running] == [process_id]

    follow = service.stub.AttachProcess(pb.AttachProcessRequest(environment_id=env.id, process_id=process_id), metadata=md())
    first = await follow.read()
    assert first.chunk.data == b"out=/workspace/outputs\n"

    killed = await service.stub.KillProcess(pb.KillProcessRequest(environment_id=env.id, process_id=process_id), metadata=md())
    assert killed.process.process_id == process_id
    last = None
    async for message in follow:
        last = message
    assert last is not None and last.HasField("exit")

    count = 'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline 2>/dev/null; echo; done | grep -c "^sleep 317" || true'

    async def gone() -> bool:
        _, out = await run_command(service.stub, env.id, count)
        return out.strip() == b"0"

    await wait_until(gone, timeout=10, what="the killed process is gone")


async def test_run_process_starts_a_named_process_once_and_streams_the_process_then_its_output_and_exit(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_owner")).environment
    start = pb.StartProcessRequest(
        environment_id=env.id,
        session_id="sess_owner",
        name="exec-call_1",
        shell='echo run >> /workspace/runs; echo "out=$REBYTE_OUTPUT_DIR"; exit 3',
        by_name=True,
    )

    async def run_once() -> tuple[list[str], str, bytes, int]:
        kinds: list[str] = []
        process_id, out, code = "", b"", -1
        async for message in service.stub.RunProcess(pb.RunProcessRequest(start=start), metadata=md()):
            kind = str(message.WhichOneof("event"))
            kinds.append(kind)
            if kind == "process":
                process_id = message.process.process_id
            elif kind == "chunk":
                out += message.chunk.data
            else:
                code = message.exit.exit_code
        return kinds, process_id, out, code

    kinds, process_id, out, code = await run_once()
    assert (kinds[0], kinds[-1], out, code) == ("process", "exit", b"out=/workspace/outputs\n", 3)
    assert set(kinds[1:-1]) <= {"chunk"}
    # By name again: the same process, its output replayed from its first chunk, no second run.
    again_kinds, again_id, again_out, again_code = await run_once()
    assert (again_kinds[0], again_id, again_out, again_code) == ("process", process_id, out, 3)
    assert await run_command(service.stub, env.id, "cat /workspace/runs") == (0, b"run\n")

    # Another organization's environment is not found, and nothing runs.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in service.stub.RunProcess(pb.RunProcessRequest(start=start), metadata=md("org_b")):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert await run_command(service.stub, env.id, "cat /workspace/runs") == (0, b"run\n")


@pytest.fixture
async def session_store(tmp_path: Path) -> AsyncIterator[Store]:
    url = Settings(session_database_url=f"sqlite+berth:///{tmp_path / 'session.db'}").database_url("session")
    db = await open_database(url, "session", _SESSION_MIGRATIONS)
    try:
        yield Store(db)
    finally:
        await db.dispose()


async def test_the_session_environment_port_runs_commands_files_and_processes_and_raises_domain_errors(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService, session_store: Store
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_owner")).environment
    client = EnvironmentClient(
        service.handle.address, credentials=credentials("session"), timeout_s=30, setup_timeout_s=60
    )
    writer = TurnWriter(session_store, session_id="sess_owner", turn_id="turn_1", agent_config_json='{"config": {}}', transcript=[])
    port = TurnEnvironment(writer, client, environment_id=env.id, environment=None)
    # The Session service's calls carry the organization of the request they serve.
    org_id_var.set("org_a")
    try:
        events = [event async for event in port.exec("echo hi; exit 3", cwd="", timeout_ms=30_000)]
        assert events[0] == CommandOutput(b"hi\n")
        assert isinstance(events[-1], CommandExit) and events[-1].exit_code == 3

        await port.write_file("/workspace/note.txt", b"0123456789")
        assert await port.read_file("/workspace/note.txt", limit=4) == (b"0123", True)
        with pytest.raises(errors.NotFound):
            await port.read_file("/workspace/missing.txt", limit=4)
        with pytest.raises(errors.InvalidArgument):
            await port.write_file("/etc/passwd", b"x")

        process = await port.start_process("echo ready; exec sleep 318", name="server", cwd="", keepalive=False)
        assert process.running
        output = port.process_output(process.process_id, from_seq=0)
        async with contextlib.aclosing(output):
            assert await anext(output) == CommandOutput(b"ready\n")
        # Closing the stream left the process running.
        assert [p.process_id for p in await port.list_processes() if p.running] == [process.process_id]

        await port.kill_process(process.process_id)

        async def exited() -> bool:
            return not any(p.running for p in await port.list_processes())

        await wait_until(exited, timeout=10, what="the killed process exited")
        # Following an exited process replays its output, then its exit.
        replay = [event async for event in port.process_output(process.process_id, from_seq=0)]
        assert replay[0] == CommandOutput(b"ready\n") and isinstance(replay[-1], CommandExit)
    finally:
        await client.close()


async def test_the_port_writes_a_process_stdin_and_removes_files_inside_the_workspace_only(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService, session_store: Store
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_owner")).environment
    client = EnvironmentClient(
        service.handle.address, credentials=credentials("session"), timeout_s=30, setup_timeout_s=60
    )
    writer = TurnWriter(session_store, session_id="sess_owner", turn_id="turn_1", agent_config_json='{"config": {}}', transcript=[])
    port = TurnEnvironment(writer, client, environment_id=env.id, environment=None)
    org_id_var.set("org_a")
    try:
        process = await port.start_process("tr a-z A-Z", name="upper", cwd="", keepalive=False, stdin=True)
        assert process.stdin_open
        closed = await port.write_stdin(process.process_id, b"hello\n", close=True)
        assert not closed.stdin_open
        events = [event async for event in port.process_output(process.process_id, from_seq=0)]
        assert [e.seq for e in events if isinstance(e, CommandOutput)] == [0]
        assert events[0] == CommandOutput(b"HELLO\n") and isinstance(events[-1], CommandExit)
        with pytest.raises(errors.FailedPrecondition):
            await port.write_stdin(process.process_id, b"more\n", close=False)

        await port.write_file("/workspace/gone.txt", b"x")
        await port.remove_file("/workspace/gone.txt")
        with pytest.raises(errors.NotFound):
            await port.read_file("/workspace/gone.txt", limit=4)
        with pytest.raises(errors.InvalidArgument):
            await port.remove_file("/workspace/../etc/passwd")
    finally:
        await client.close()
