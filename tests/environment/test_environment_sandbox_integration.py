"""The Environment service against the real Sandbox service (bubblewrap)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import zipfile

import grpc
import pytest
from environment_helpers import (
    Cluster,
    EnvService,
    SandboxService,
    create_env,
    ensure,
    get_env,
    md,
    reason_of,
    run_command,
    setup_config,
)
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb
from berth.sandbox.v1 import sandbox_service_pb2

SETUP = "echo ran >> /workspace/setup.log"
READY = environment_pb2.ENVIRONMENT_STATUS_READY
FAILED = environment_pb2.ENVIRONMENT_STATUS_FAILED


async def read(service: EnvService, environment_id: str, path: str) -> bytes:
    data = b""
    async for chunk in service.stub.ReadWorkspaceFile(pb.ReadWorkspaceFileRequest(environment_id=environment_id, path=path), metadata=md()):
        data += chunk.data
    return data


async def first_operation(service: EnvService, environment_id: str, i: int) -> bool:
    if i % 3 == 0:
        return (await ensure(service.stub, environment_id)).status == READY
    if i % 3 == 1:
        await service.stub.WriteWorkspaceFile(
            pb.WriteWorkspaceFileRequest(environment_id=environment_id, path=f"/workspace/w/{i}.txt", data=b"x"), metadata=md()
        )
        return True
    return (await service.stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=environment_id), metadata=md())) is not None


async def test_fifty_concurrent_first_operations_run_setup_once_in_a_real_sandbox(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, config=setup_config(SETUP))).environment
    results = await asyncio.wait_for(asyncio.gather(*(first_operation(service, env.id, i) for i in range(50))), 60)
    assert all(results)
    assert await read(service, env.id, "/workspace/setup.log") == b"ran\n"


async def test_two_instances_sharing_a_database_run_setup_once_in_a_real_sandbox(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService
) -> None:
    one = await cluster.start(database_url, sandbox_addr=sandbox_service.address)
    two = await cluster.start(database_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(one.stub, config=setup_config(SETUP))).environment
    calls = [first_operation(one if i % 2 else two, env.id, i) for i in range(50)]
    assert all(await asyncio.wait_for(asyncio.gather(*calls), 60))
    assert await read(two, env.id, "/workspace/setup.log") == b"ran\n"


async def test_a_failing_setup_command_fails_the_environment_once(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, config=setup_config("true", "echo ran >> /workspace/runs.log; exit 3"))).environment
    results = await asyncio.gather(*(ensure(service.stub, env.id) for _ in range(5)))
    assert {r.status for r in results} == {FAILED}
    assert results[0].error.code == "setup_command_failed" and "runs.log" not in results[0].error.message
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(service.stub, env.id, "true")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and reason_of(info.value) == "ENVIRONMENT_FAILED"
    assert (await ensure(service.stub, env.id)).status == FAILED
    # The sandbox identity is preserved, and the command ran exactly once.
    assert await sandbox_service.read(env.sandbox_id, "/workspace/runs.log") == b"ran\n"


async def test_commands_see_their_session_output_directory_and_the_owner_collector_skips_sessions(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_owner")).environment
    await service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id="sess_ref"), metadata=md())
    show = 'echo "$REBYTE_OUTPUT_DIR|$REBYTE_SESSION_ID|$BERTH_OUTPUT_DIR"; echo done > "$REBYTE_OUTPUT_DIR/result.txt"'
    code, out = await run_command(service.stub, env.id, show, session_id="sess_ref")
    assert code == 0
    assert out == b"/workspace/outputs/sessions/sess_ref|sess_ref|/workspace/outputs/sessions/sess_ref\n"
    code, out = await run_command(service.stub, env.id, show, session_id="sess_owner")
    assert code == 0 and out == b"/workspace/outputs|sess_owner|/workspace/outputs\n"
    owner = await service.stub.ListSessionOutputs(
        pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_owner"), metadata=md()
    )
    assert [e.path for e in owner.entries] == ["/workspace/outputs/result.txt"]
    ref = await service.stub.ListSessionOutputs(pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_ref"), metadata=md())
    assert [e.path for e in ref.entries] == ["/workspace/outputs/sessions/sess_ref/result.txt"]


async def test_a_session_output_listing_carries_the_environment_as_get_environment_returns_it(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, config=setup_config("true"), owner_session_id="sess_owner")).environment
    request = pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_owner")
    # Not ready yet (setup has not run): no snapshot to keep.
    assert not (await service.stub.ListSessionOutputs(request, metadata=md())).HasField("environment")
    assert (await ensure(service.stub, env.id)).status == READY
    await service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id="sess_ref"), metadata=md())

    listed = await service.stub.ListSessionOutputs(request, metadata=md())

    assert listed.environment == await get_env(service.stub, env.id)
    assert listed.environment.session_count == 2
    assert len(listed.environment.config.setup_commands) == 1


async def test_an_unreachable_sandbox_service_is_unavailable_and_never_fails_the_environment(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    unreachable = await cluster.start(sqlite_url)  # dials a closed port
    env = (await create_env(unreachable.stub, config=setup_config(SETUP))).environment
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ensure(unreachable.stub, env.id)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert (await get_env(unreachable.stub, env.id)).status == environment_pb2.ENVIRONMENT_STATUS_PENDING
    await cluster.stop(unreachable)
    reachable = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    assert (await ensure(reachable.stub, env.id)).status == READY
    assert await read(reachable, env.id, "/workspace/setup.log") == b"ran\n"


async def test_a_sandbox_service_outage_after_setup_keeps_the_environment_and_its_files(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_a", config=setup_config(SETUP))).environment
    await ensure(service.stub, env.id)
    await cluster.stop(service)
    cut_off = await cluster.start(sqlite_url)  # the same database, sandbox service unreachable
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(cut_off.stub, env.id, "true", session_id="sess_a")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert env.id in (info.value.details() or "") and "sess_a" in (info.value.details() or "")
    assert (await get_env(cut_off.stub, env.id)).status == READY
    await cluster.stop(cut_off)
    back = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    assert await read(back, env.id, "/workspace/setup.log") == b"ran\n"


async def test_the_private_owner_detaching_destroys_the_real_sandbox(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub, owner_session_id="sess_a")).environment
    await ensure(service.stub, env.id)
    detached = await service.stub.DetachSession(pb.DetachSessionRequest(environment_id=env.id, session_id="sess_a"), metadata=md())
    assert detached.environment_deleted
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sandbox_service.stub.GetSandbox(sandbox_service_pb2.GetSandboxRequest(sandbox_id=env.sandbox_id), metadata=md())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_cancelling_exec_kills_the_command_in_the_sandbox(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub)).environment
    call = service.stub.ExecCommand(pb.ExecCommandRequest(environment_id=env.id, shell="echo started; exec sleep 313"), metadata=md())
    first = await asyncio.wait_for(call.read(), 30)
    assert first.chunk.data == b"started\n"
    call.cancel()
    count = 'for p in /proc/[0-9]*; do tr "\\0" " " < $p/cmdline 2>/dev/null; echo; done | grep -c "^sleep 313" || true'

    async def gone() -> bool:
        _, out = await run_command(service.stub, env.id, count)
        return out.strip() == b"0"

    await wait_until(gone, timeout=10, what="the cancelled command was killed")


async def test_initial_files_and_inline_skills_land_in_the_real_workspace(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("SKILL.md", "# Lint")
    skill = {"type": "inline", "name": "lint", "description": "d", "source": {"type": "base64", "media_type": "application/zip",
             "data": base64.b64encode(buffer.getvalue()).decode()}}
    config = environment_pb2.EnvironmentConfig(
        files=[environment_pb2.InitialFile(path="/workspace/in/input.txt", data=b"Shared input")],
        skills_json=json.dumps([skill]),
        env={"GREETING": "hello"},
        setup_commands=[environment_pb2.SetupCommand(command='cat input.txt > copy.txt; echo "$GREETING" >> copy.txt', cwd="/workspace/in")],
    )
    env = (await create_env(service.stub, config=config)).environment
    assert (await ensure(service.stub, env.id)).status == READY
    assert await read(service, env.id, "/workspace/in/copy.txt") == b"Shared inputhello\n"
    assert await read(service, env.id, "/workspace/.skills/lint/SKILL.md") == b"# Lint"
    code, out = await run_command(service.stub, env.id, 'echo "$GREETING"')
    assert (code, out) == (0, b"hello\n")


async def test_live_environment_files_page_through_the_real_workspace(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    service = await cluster.start(sqlite_url, sandbox_addr=sandbox_service.address)
    env = (await create_env(service.stub)).environment
    code, _ = await run_command(service.stub, env.id, "mkdir -p d && for f in a b c d/e; do echo x > $f; done")
    assert code == 0
    created = await service.stub.CreateEnvironmentFile(
        pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/f", data=b"12345"), metadata=md()
    )
    seen: list[str] = []
    token = ""
    while True:
        page = await service.stub.ListEnvironmentFiles(
            pb.ListEnvironmentFilesRequest(environment_id=env.id, order="asc", page_size=2, page_token=token), metadata=md()
        )
        seen += [f.path for f in page.files]
        for f in page.files:
            if f.path == "/workspace/f":
                assert (f.id, f.size_bytes) == (created.file.id, 5)
        token = page.next_page_token
        if not token:
            break
    assert seen == ["/workspace/a", "/workspace/b", "/workspace/c", "/workspace/d/e", "/workspace/f"]
