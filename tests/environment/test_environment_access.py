"""Organization scoping, workspace path rules and per-session output
directories (with the in-memory compute)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from environment_fakes import FakeCompute
from environment_helpers import EnvService, create_env, ensure, md, reason_of, run_command

from berth.environment.v1 import environment_service_pb2 as pb


async def drain(call: Any) -> None:
    async for _ in call:
        pass


def every_environment_rpc(stub: Any, environment_id: str, org: str) -> list[Callable[[], Awaitable[Any]]]:
    m = md(org)
    e = environment_id
    return [
        lambda: stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=e), metadata=m),
        lambda: stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=e), metadata=m),
        lambda: stub.AttachSession(pb.AttachSessionRequest(environment_id=e, session_id="sess_x"), metadata=m),
        lambda: stub.DetachSession(pb.DetachSessionRequest(environment_id=e, session_id="sess_a"), metadata=m),
        lambda: stub.GetBinding(pb.GetBindingRequest(environment_id=e, session_id="sess_a"), metadata=m),
        lambda: stub.EnsureEnvironmentReady(pb.EnsureEnvironmentReadyRequest(environment_id=e), metadata=m),
        lambda: drain(stub.ExecCommand(pb.ExecCommandRequest(environment_id=e, shell="true"), metadata=m)),
        lambda: drain(stub.ExecCommand(pb.ExecCommandRequest(environment_id=e, session_id="sess_a", shell="true"), metadata=m)),
        lambda: drain(stub.ReadWorkspaceFile(pb.ReadWorkspaceFileRequest(environment_id=e, path="/workspace/a"), metadata=m)),
        lambda: stub.WriteWorkspaceFile(pb.WriteWorkspaceFileRequest(environment_id=e, path="/workspace/a"), metadata=m),
        lambda: stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=e), metadata=m),
        lambda: stub.ListSessionOutputs(pb.ListSessionOutputsRequest(environment_id=e, session_id="sess_a"), metadata=m),
        lambda: stub.CreateEnvironmentFile(pb.CreateEnvironmentFileRequest(environment_id=e, path="/workspace/a", data=b""), metadata=m),
        lambda: stub.ListEnvironmentFiles(pb.ListEnvironmentFilesRequest(environment_id=e), metadata=m),
    ]


@pytest.mark.parametrize("ready", [False, True])
async def test_another_organizations_environment_is_not_found_on_every_rpc(
    env_service: EnvService, fake: FakeCompute, ready: bool
) -> None:
    env = (await create_env(env_service.stub, owner_session_id="sess_a")).environment
    if ready:
        await ensure(env_service.stub, env.id)
    executions = len(fake.execs)
    for call in every_environment_rpc(env_service.stub, env.id, "org_b"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert reason_of(info.value) == "NOT_FOUND"
    assert len(fake.execs) == executions and len(fake.created) == (1 if ready else 0)
    listed = await env_service.stub.ListEnvironments(pb.ListEnvironmentsRequest(), metadata=md("org_b"))
    assert list(listed.environments) == []


@pytest.mark.parametrize("environment_id", ["env_unknown", "", "../env", "env_" + "0" * 25])
async def test_malformed_or_unknown_environment_ids_are_not_found(env_service: EnvService, environment_id: str) -> None:
    for call in every_environment_rpc(env_service.stub, environment_id, "org_a"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_call_without_an_organization_is_unauthenticated(env_service: EnvService) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env_service.stub.ListEnvironments(pb.ListEnvironmentsRequest())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("path", ["/etc/passwd", "relative/a", "/workspace/../etc/passwd", "/workspace/./a", "/workspacex/a", "//workspace/a"])
async def test_paths_outside_the_workspace_are_invalid(env_service: EnvService, fake: FakeCompute, path: str) -> None:
    env = (await create_env(env_service.stub)).environment
    stub, e = env_service.stub, env.id
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: drain(stub.ReadWorkspaceFile(pb.ReadWorkspaceFileRequest(environment_id=e, path=path), metadata=md())),
        lambda: stub.WriteWorkspaceFile(pb.WriteWorkspaceFileRequest(environment_id=e, path=path), metadata=md()),
        lambda: stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=e, path=path), metadata=md()),
        lambda: stub.CreateEnvironmentFile(pb.CreateEnvironmentFileRequest(environment_id=e, path=path, data=b"x"), metadata=md()),
        lambda: stub.ListEnvironmentFiles(pb.ListEnvironmentFilesRequest(environment_id=e, path=path), metadata=md()),
        lambda: drain(stub.ExecCommand(pb.ExecCommandRequest(environment_id=e, shell="true", cwd=path), metadata=md())),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert reason_of(info.value) == "PATH_OUTSIDE_WORKSPACE"
    assert fake.created == []  # rejected before the guard


async def test_commands_get_the_output_directory_of_their_session(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub, owner_session_id="sess_a")).environment
    await env_service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id="sess_b"), metadata=md())
    await run_command(env_service.stub, env.id, "echo owner", session_id="sess_a")
    await run_command(env_service.stub, env.id, "echo ref", session_id="sess_b")
    await run_command(env_service.stub, env.id, "echo ref again", session_id="sess_b")
    await run_command(env_service.stub, env.id, "echo direct")
    by_command = {c.shell: c.env for c in fake.execs if c.shell}
    assert by_command["echo owner"]["REBYTE_OUTPUT_DIR"] == "/workspace/outputs"
    assert by_command["echo owner"]["BERTH_OUTPUT_DIR"] == "/workspace/outputs"
    assert by_command["echo ref"]["REBYTE_OUTPUT_DIR"] == "/workspace/outputs/sessions/sess_b"
    assert by_command["echo ref"]["REBYTE_SESSION_ID"] == by_command["echo ref"]["BERTH_SESSION_ID"] == "sess_b"
    assert "REBYTE_OUTPUT_DIR" not in by_command["echo direct"]
    # Each session's directory is made once, by sandboxd: no process.
    assert [path for _, path in fake.directories] == ["/workspace/outputs", "/workspace/outputs/sessions/sess_b"]
    assert not [c for c in fake.execs if c.argv[:1] == ["mkdir"]]


async def test_a_session_that_is_not_bound_cannot_run_commands(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub)).environment
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(env_service.stub, env.id, "true", session_id="sess_stranger")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert fake.created == []


async def test_outputs_of_a_never_initialized_environment_are_empty_without_initializing(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env = (await create_env(env_service.stub, owner_session_id="sess_a")).environment
    outputs = await env_service.stub.ListSessionOutputs(
        pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_a"), metadata=md()
    )
    assert outputs.output_dir == "/workspace/outputs" and list(outputs.entries) == []
    assert fake.created == []


async def test_the_owner_collector_excludes_the_sessions_subtree(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub, owner_session_id="sess_a")).environment
    await env_service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id="sess_b"), metadata=md())
    await ensure(env_service.stub, env.id)
    files = fake.files[env.sandbox_id]
    files["/workspace/outputs/report.md"] = b"owner"
    files["/workspace/outputs/sub/chart.png"] = b"owner"
    files["/workspace/outputs/sessions/sess_b/answer.txt"] = b"ref"
    files["/workspace/notes.txt"] = b"not an output"
    owner = await env_service.stub.ListSessionOutputs(
        pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_a"), metadata=md()
    )
    assert [e.path for e in owner.entries] == ["/workspace/outputs/report.md", "/workspace/outputs/sub/chart.png"]
    ref = await env_service.stub.ListSessionOutputs(
        pb.ListSessionOutputsRequest(environment_id=env.id, session_id="sess_b"), metadata=md()
    )
    assert ref.output_dir == "/workspace/outputs/sessions/sess_b"
    assert [e.path for e in ref.entries] == ["/workspace/outputs/sessions/sess_b/answer.txt"]


async def test_exec_needs_exactly_one_of_argv_and_shell(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    for request in (
        pb.ExecCommandRequest(environment_id=env.id),
        pb.ExecCommandRequest(environment_id=env.id, argv=["true"], shell="true"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await drain(env_service.stub.ExecCommand(request, metadata=md()))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
