"""Creation, sharing, detaching and deletion through the real gRPC server
(with the in-memory compute)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from environment_fakes import ExecCall, FakeCompute
from environment_helpers import EnvService, create_env, ensure, get_env, md, reason_of, setup_config

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb

SESSION_A = "sess_a"
SESSION_B = "sess_b"


async def attach(service: EnvService, environment_id: str, session_id: str, org: str = "org_a") -> pb.AttachSessionResponse:
    response: pb.AttachSessionResponse = await service.stub.AttachSession(
        pb.AttachSessionRequest(environment_id=environment_id, session_id=session_id), metadata=md(org)
    )
    return response


async def detach(service: EnvService, environment_id: str, session_id: str) -> bool:
    response = await service.stub.DetachSession(
        pb.DetachSessionRequest(environment_id=environment_id, session_id=session_id), metadata=md()
    )
    return bool(response.environment_deleted)


async def delete(service: EnvService, environment_id: str) -> None:
    await service.stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=environment_id), metadata=md())


async def test_creating_an_environment_allocates_no_sandbox_and_is_pending(env_service: EnvService, fake: FakeCompute) -> None:
    created = await create_env(env_service.stub, config=setup_config("echo hi"))
    env = created.environment
    assert env.status == environment_pb2.ENVIRONMENT_STATUS_PENDING
    assert env.lifetime == environment_pb2.LIFETIME_PRIVATE
    assert env.id.startswith("env_") and env.sandbox_id.startswith("sbx_")
    assert env.session_count == 0 and not created.HasField("binding")
    assert fake.created == [] and fake.execs == []
    again = await get_env(env_service.stub, env.id)
    assert again.status == environment_pb2.ENVIRONMENT_STATUS_PENDING and again.sandbox_id == env.sandbox_id


async def test_setup_command_bodies_never_leave_the_service(env_service: EnvService) -> None:
    created = await create_env(env_service.stub, config=setup_config("echo secret-token"))
    assert [c.command for c in created.environment.config.setup_commands] == [""]
    assert "secret-token" not in str(await get_env(env_service.stub, created.environment.id))


async def test_an_inline_owner_gets_the_private_outputs_directory(env_service: EnvService) -> None:
    created = await create_env(env_service.stub, owner_session_id=SESSION_A)
    assert created.environment.session_count == 1
    assert created.binding.role == environment_pb2.BINDING_ROLE_OWNER
    assert created.binding.output_dir == "/workspace/outputs"


async def test_a_reference_to_a_pending_environment_makes_it_shared_with_a_session_directory(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env = (await create_env(env_service.stub, owner_session_id=SESSION_A)).environment
    attached = await attach(env_service, env.id, SESSION_B)
    assert attached.environment.lifetime == environment_pb2.LIFETIME_SHARED
    assert attached.environment.ever_shared and attached.environment.session_count == 2
    assert attached.binding.role == environment_pb2.BINDING_ROLE_REFERENCE
    assert attached.binding.output_dir == f"/workspace/outputs/sessions/{SESSION_B}"
    assert attached.environment.status == environment_pb2.ENVIRONMENT_STATUS_PENDING
    assert fake.created == []  # attaching never triggers setup


async def test_attaching_the_same_session_twice_returns_the_existing_binding(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    first = await attach(env_service, env.id, SESSION_B)
    second = await attach(env_service, env.id, SESSION_B)
    assert second.binding == first.binding and second.environment.session_count == 1


async def test_every_session_on_a_standalone_environment_uses_its_own_directory(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    for session_id in (SESSION_A, SESSION_B):
        binding = (await attach(env_service, env.id, session_id)).binding
        assert binding.output_dir == f"/workspace/outputs/sessions/{session_id}"


async def test_referencing_while_setup_runs_is_initialization_running(env_service: EnvService, fake: FakeCompute) -> None:
    fake.create_gate = asyncio.Event()
    env = (await create_env(env_service.stub)).environment
    waiter = asyncio.ensure_future(ensure(env_service.stub, env.id))
    await asyncio.wait_for(fake.create_started.wait(), 10)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await attach(env_service, env.id, SESSION_B)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(info.value) == "INITIALIZATION_RUNNING"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await delete(env_service, env.id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(info.value) == "INITIALIZATION_RUNNING"
    fake.create_gate.set()
    assert (await asyncio.wait_for(waiter, 10)).status == environment_pb2.ENVIRONMENT_STATUS_READY
    # Ready is fine again.
    assert (await attach(env_service, env.id, SESSION_B)).environment.lifetime == environment_pb2.LIFETIME_SHARED


async def test_a_shared_environment_survives_the_detach_of_all_its_sessions(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub, owner_session_id=SESSION_A)).environment
    await attach(env_service, env.id, SESSION_B)
    await ensure(env_service.stub, env.id)
    assert await detach(env_service, env.id, SESSION_A) is False
    assert await detach(env_service, env.id, SESSION_B) is False
    after = await get_env(env_service.stub, env.id)
    assert after.lifetime == environment_pb2.LIFETIME_SHARED and after.session_count == 0
    assert after.status == environment_pb2.ENVIRONMENT_STATUS_READY
    assert fake.destroyed == []


async def test_the_private_owner_detaching_deletes_the_environment_and_its_sandbox(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub, owner_session_id=SESSION_A)).environment
    await ensure(env_service.stub, env.id)
    assert await detach(env_service, env.id, SESSION_A) is True
    assert fake.destroyed == [env.sandbox_id]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await get_env(env_service.stub, env.id)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_never_initialized_private_environment_is_deleted_without_a_sandbox_call(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env = (await create_env(env_service.stub, owner_session_id=SESSION_A)).environment
    fake.unavailable = True  # no sandbox call may happen
    assert await detach(env_service, env.id, SESSION_A) is True
    assert fake.destroyed == []


async def test_the_private_owner_detaching_during_setup_waits_for_it_then_deletes(
    env_service: EnvService, fake: FakeCompute
) -> None:
    fake.create_gate = asyncio.Event()
    env = (await create_env(env_service.stub, owner_session_id=SESSION_A)).environment
    waiter = asyncio.ensure_future(ensure(env_service.stub, env.id))
    await asyncio.wait_for(fake.create_started.wait(), 10)
    detaching = asyncio.ensure_future(detach(env_service, env.id, SESSION_A))
    done, _ = await asyncio.wait([detaching], timeout=0.2)
    assert not done  # blocked while setup runs
    fake.create_gate.set()
    assert await asyncio.wait_for(detaching, 10) is True
    await asyncio.wait_for(asyncio.gather(waiter, return_exceptions=True), 10)
    assert fake.destroyed == [env.sandbox_id]


async def test_deleting_an_environment_with_a_binding_is_environment_in_use(env_service: EnvService) -> None:
    env = (await create_env(env_service.stub)).environment
    await attach(env_service, env.id, SESSION_B)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await delete(env_service, env.id)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason_of(info.value) == "ENVIRONMENT_IN_USE"
    await detach(env_service, env.id, SESSION_B)
    await delete(env_service, env.id)


async def test_a_deleted_environment_is_not_found_and_its_sandbox_destroyed(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub)).environment
    await ensure(env_service.stub, env.id)
    await delete(env_service, env.id)
    assert fake.destroyed == [env.sandbox_id]
    for call in (
        get_env(env_service.stub, env.id),
        ensure(env_service.stub, env.id),
        delete(env_service, env.id),
        attach(env_service, env.id, SESSION_B),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_deleting_a_failed_environment_destroys_its_sandbox(env_service: EnvService, fake: FakeCompute) -> None:
    async def fail(call: ExecCall) -> int:
        return 1

    fake.exec_handler = fail
    env = (await create_env(env_service.stub, config=setup_config("false"))).environment
    assert (await ensure(env_service.stub, env.id)).status == environment_pb2.ENVIRONMENT_STATUS_FAILED
    await delete(env_service, env.id)
    assert fake.destroyed == [env.sandbox_id]


async def test_an_unreachable_sandbox_on_delete_keeps_the_environment(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub)).environment
    await ensure(env_service.stub, env.id)
    fake.unavailable = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await delete(env_service, env.id)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert (await get_env(env_service.stub, env.id)).status == environment_pb2.ENVIRONMENT_STATUS_READY
    fake.unavailable = False
    await delete(env_service, env.id)


async def test_environments_list_by_creation_with_cursor_pages(env_service: EnvService) -> None:
    # IDs order by creation time (ties within a millisecond break randomly).
    ids = sorted([(await create_env(env_service.stub)).environment.id for _ in range(3)])
    await create_env(env_service.stub, org="org_b")
    page = await env_service.stub.ListEnvironments(pb.ListEnvironmentsRequest(page_size=2), metadata=md())
    assert [e.id for e in page.environments] == ids[::-1][:2] and page.has_more
    rest = await env_service.stub.ListEnvironments(
        pb.ListEnvironmentsRequest(page_size=2, after=page.environments[-1].id), metadata=md()
    )
    assert [e.id for e in rest.environments] == [ids[0]] and not rest.has_more
    asc = await env_service.stub.ListEnvironments(pb.ListEnvironmentsRequest(order="asc"), metadata=md())
    assert [e.id for e in asc.environments] == ids
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await env_service.stub.ListEnvironments(pb.ListEnvironmentsRequest(page_size=101), metadata=md())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("config", "param"),
    [
        (environment_pb2.EnvironmentConfig(files=[environment_pb2.InitialFile(path="/etc/passwd", data=b"x")]), "environment.files[0].path"),
        (environment_pb2.EnvironmentConfig(files=[environment_pb2.InitialFile(path="/workspace/../etc", data=b"x")]), "environment.files[0].path"),
        (environment_pb2.EnvironmentConfig(files=[environment_pb2.InitialFile(path="workspace/a", data=b"x")]), "environment.files[0].path"),
        # The network policy's and container size's shape is checked by the
        # gateway (tests/e2e/test_api_validation.py).
        (environment_pb2.EnvironmentConfig(skills_json='[{"type": "inline", "data": "not-a-zip"}]'), "environment.skills[0]"),
    ],
)
async def test_invalid_configuration_is_rejected_with_its_parameter(
    env_service: EnvService, config: environment_pb2.EnvironmentConfig, param: str
) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create_env(env_service.stub, config=config)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    detail = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(detail)
    assert detail.metadata["param"] == param


async def test_an_unknown_file_id_in_a_configuration_is_not_found_with_its_parameter(env_service: EnvService) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    config = environment_pb2.EnvironmentConfig(files=[environment_pb2.InitialFile(path="/workspace/a", file_id="file-missing")])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await create_env(env_service.stub, config=config)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    status = rpc_status.from_call(info.value)  # type: ignore[arg-type]
    assert status is not None
    detail = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(detail)
    assert detail.metadata["param"] == "environment.files[0].file_id"


async def test_blocked_domains_are_accepted_with_restricted_access(env_service: EnvService) -> None:
    config = environment_pb2.EnvironmentConfig(
        network=common_pb2.NetworkPolicy(access=common_pb2.NETWORK_ACCESS_RESTRICTED, blocked_domains=["example.com"])
    )
    env = (await create_env(env_service.stub, config=config)).environment
    assert list(env.config.network.blocked_domains) == ["example.com"]
