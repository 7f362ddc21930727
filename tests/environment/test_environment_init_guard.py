"""The init-once guard through the real gRPC server, on SQLite and
PostgreSQL, with the in-memory compute (the guard is pure coordination)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from environment_fakes import ExecCall, FakeCompute
from environment_helpers import Cluster, EnvService, create_env, ensure, get_env, md, reason_of, run_command, setup_config
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb
from services.core.settings import normalize_database_url

SETUP = "echo ran >> /workspace/setup.log"
READY = environment_pb2.ENVIRONMENT_STATUS_READY
FAILED = environment_pb2.ENVIRONMENT_STATUS_FAILED
PENDING = environment_pb2.ENVIRONMENT_STATUS_PENDING


async def first_operation(service: EnvService, environment_id: str, i: int) -> environment_pb2.EnvironmentStatus.ValueType:
    """Alternates the kinds of first operation that enter the guard."""
    if i % 3 == 0:
        return (await ensure(service.stub, environment_id)).status
    if i % 3 == 1:
        await service.stub.WriteWorkspaceFile(
            pb.WriteWorkspaceFileRequest(environment_id=environment_id, path=f"/workspace/f{i}", data=b"x"), metadata=md()
        )
    else:
        code, _ = await run_command(service.stub, environment_id, "true")
        assert code == 0
    return READY


async def execute(database_url: str, sql: str, **params: object) -> None:
    engine = create_async_engine(normalize_database_url(database_url))
    try:
        async with engine.begin() as conn:
            await conn.execute(text(sql), params)
    finally:
        await engine.dispose()


async def test_fifty_concurrent_first_operations_run_setup_exactly_once(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    service = await cluster.start(database_url, compute=fake)
    env = (await create_env(service.stub, config=setup_config(SETUP))).environment
    statuses = await asyncio.wait_for(asyncio.gather(*(first_operation(service, env.id, i) for i in range(50))), 30)
    assert statuses == [READY] * 50
    assert fake.setup_runs(SETUP) == 1 and len(fake.created) == 1


async def test_two_service_instances_on_one_database_run_setup_exactly_once(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    one = await cluster.start(database_url, compute=fake)
    two = await cluster.start(database_url, compute=fake)
    env = (await create_env(one.stub, config=setup_config(SETUP))).environment
    calls = [first_operation(one if i % 2 else two, env.id, i) for i in range(50)]
    statuses = await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert statuses == [READY] * 50
    assert fake.setup_runs(SETUP) == 1 and len(fake.created) == 1


async def test_a_failed_setup_is_recorded_and_never_rerun(cluster: Cluster, database_url: str, fake: FakeCompute) -> None:
    async def exit_3(call: ExecCall) -> int:
        return 3 if call.shell == "exit 3" else 0

    fake.exec_handler = exit_3
    service = await cluster.start(database_url, compute=fake)
    env = (await create_env(service.stub, config=setup_config("true", "exit 3"), owner_session_id="sess_a")).environment
    failed = await ensure(service.stub, env.id)
    assert failed.status == FAILED
    assert failed.error.code == "setup_command_failed"
    assert "exit 3" not in failed.error.message  # command bodies are confidential
    assert (await ensure(service.stub, env.id)).status == FAILED
    for operation in (
        run_command(service.stub, env.id, "true"),
        run_command(service.stub, env.id, "true", session_id="sess_a"),
        service.stub.WriteWorkspaceFile(pb.WriteWorkspaceFileRequest(environment_id=env.id, path="/workspace/a", data=b""), metadata=md()),
        service.stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=env.id), metadata=md()),
        service.stub.ListEnvironmentFiles(pb.ListEnvironmentFilesRequest(environment_id=env.id), metadata=md()),
        service.stub.CreateEnvironmentFile(pb.CreateEnvironmentFileRequest(environment_id=env.id, path="/workspace/a", data=b"x"), metadata=md()),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await operation
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(info.value) == "ENVIRONMENT_FAILED"
    assert fake.setup_runs("exit 3") == 1 and fake.setup_runs("true") == 1 and len(fake.created) == 1
    assert (await get_env(service.stub, env.id)).error.code == "setup_command_failed"


async def test_a_cancelled_waiter_does_not_cancel_setup(env_service: EnvService, fake: FakeCompute) -> None:
    fake.create_gate = asyncio.Event()
    env = (await create_env(env_service.stub, config=setup_config(SETUP))).environment
    call = env_service.stub.EnsureEnvironmentReady(pb.EnsureEnvironmentReadyRequest(environment_id=env.id), metadata=md())
    await asyncio.wait_for(fake.create_started.wait(), 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    other = asyncio.ensure_future(ensure(env_service.stub, env.id))
    fake.create_gate.set()
    assert (await asyncio.wait_for(other, 10)).status == READY
    assert fake.setup_runs(SETUP) == 1


async def test_a_waiter_cancelled_before_setup_starts_leaves_setup_running(env_service: EnvService, fake: FakeCompute) -> None:
    fake.create_gate = asyncio.Event()
    env = (await create_env(env_service.stub, config=setup_config(SETUP))).environment
    call = env_service.stub.EnsureEnvironmentReady(pb.EnsureEnvironmentReadyRequest(environment_id=env.id), metadata=md())
    await asyncio.wait_for(fake.create_started.wait(), 10)
    call.cancel()
    fake.create_gate.set()
    await wait_until(lambda: fake.setup_runs(SETUP) == 1, what="setup ran to the end")
    assert (await get_env(env_service.stub, env.id)).status in (READY, environment_pb2.ENVIRONMENT_STATUS_INITIALIZING)
    assert (await ensure(env_service.stub, env.id)).status == READY


async def test_an_expired_lease_is_taken_over_and_setup_runs_to_ready(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    service = await cluster.start(database_url, compute=fake)
    env = (await create_env(service.stub, config=setup_config(SETUP))).environment
    # An owner that died before it recorded any step: initializing, its lease in the past.
    await execute(
        database_url,
        "UPDATE environments SET status='initializing', init_version=1, lease_owner='dead-host:1', "
        "lease_expires_at=:expired WHERE id=:id",
        expired=time.time() - 5,
        id=env.id,
    )
    result = await asyncio.wait_for(ensure(service.stub, env.id), 10)
    assert result.status == READY and result.error.code == ""
    assert fake.setup_runs(SETUP) == 1 and fake.created_ids == [env.sandbox_id]
    code, _ = await run_command(service.stub, env.id, "true")
    assert code == 0


async def test_a_live_lease_is_renewed_so_peers_keep_waiting(cluster: Cluster, database_url: str, fake: FakeCompute) -> None:
    fake.create_gate = asyncio.Event()
    one = await cluster.start(database_url, compute=fake, init_lease_s=0.3)
    two = await cluster.start(database_url, compute=fake, init_lease_s=0.3)
    env = (await create_env(one.stub, config=setup_config(SETUP))).environment
    owner = asyncio.ensure_future(ensure(one.stub, env.id))
    await asyncio.wait_for(fake.create_started.wait(), 10)
    peer = asyncio.ensure_future(ensure(two.stub, env.id))

    engine = create_async_engine(normalize_database_url(database_url))
    seen: set[float] = set()

    async def renewed_twice() -> bool:
        async with engine.connect() as conn:
            seen.add((await conn.execute(text("SELECT lease_expires_at FROM environments WHERE id=:id"), {"id": env.id})).scalar_one())
        return len(seen) >= 3

    try:
        await wait_until(renewed_twice, timeout=10, what="the owner renews its lease")
    finally:
        await engine.dispose()
    assert not peer.done()  # the peer is still waiting: nobody declared the owner lost
    fake.create_gate.set()
    assert (await asyncio.wait_for(owner, 10)).status == READY
    assert (await asyncio.wait_for(peer, 10)).status == READY
    assert fake.setup_runs(SETUP) == 1


async def test_an_owner_that_stops_mid_setup_hands_setup_to_a_waiting_peer(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    fake.create_gate = asyncio.Event()
    one = await cluster.start(database_url, compute=fake)
    two = await cluster.start(database_url, compute=fake)
    env = (await create_env(one.stub, config=setup_config(SETUP))).environment
    owner = asyncio.ensure_future(ensure(one.stub, env.id))
    await asyncio.wait_for(fake.create_started.wait(), 10)
    peer = asyncio.ensure_future(ensure(two.stub, env.id))
    await cluster.stop(one)
    await asyncio.gather(owner, return_exceptions=True)
    fake.create_gate.set()
    result = await asyncio.wait_for(peer, 10)
    assert result.status == READY and result.error.code == ""
    # The peer created the same sandbox again (which returns it): no second one.
    assert fake.setup_runs(SETUP) == 1 and set(fake.created_ids) == {env.sandbox_id}


async def test_an_unreachable_sandbox_service_leaves_the_environment_pending(env_service: EnvService, fake: FakeCompute) -> None:
    fake.unavailable = True
    env = (await create_env(env_service.stub, config=setup_config(SETUP))).environment
    for operation in (ensure(env_service.stub, env.id), run_command(env_service.stub, env.id, "true")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await operation
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reason_of(info.value) == "SANDBOX_UNAVAILABLE"
        assert env.id in (info.value.details() or "")
    assert (await get_env(env_service.stub, env.id)).status == PENDING
    fake.unavailable = False
    assert (await ensure(env_service.stub, env.id)).status == READY
    assert fake.setup_runs(SETUP) == 1


async def test_an_unreachable_sandbox_after_setup_is_unavailable_and_keeps_the_environment(
    env_service: EnvService, fake: FakeCompute
) -> None:
    env = (await create_env(env_service.stub, owner_session_id="sess_a")).environment
    await ensure(env_service.stub, env.id)
    fake.unavailable = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(env_service.stub, env.id, "true", session_id="sess_a")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert env.id in (info.value.details() or "") and "sess_a" in (info.value.details() or "")
    assert (await get_env(env_service.stub, env.id)).status == READY
    assert fake.destroyed == [] and len(fake.created) == 1


async def test_setup_does_not_repeat_when_a_session_attaches(env_service: EnvService, fake: FakeCompute) -> None:
    env = (await create_env(env_service.stub, config=setup_config(SETUP))).environment
    await ensure(env_service.stub, env.id)
    await env_service.stub.AttachSession(pb.AttachSessionRequest(environment_id=env.id, session_id="sess_b"), metadata=md())
    await run_command(env_service.stub, env.id, "true", session_id="sess_b")
    assert fake.setup_runs(SETUP) == 1 and len(fake.created) == 1


async def test_cancelling_exec_cancels_the_sandbox_command(env_service: EnvService, fake: FakeCompute) -> None:
    started = asyncio.Event()

    async def hang(call: ExecCall) -> int:
        if call.shell == "sleep forever":
            started.set()
            await asyncio.Event().wait()
        return 0

    fake.exec_handler = hang
    env = (await create_env(env_service.stub)).environment
    call = env_service.stub.ExecCommand(pb.ExecCommandRequest(environment_id=env.id, shell="sleep forever"), metadata=md())
    reader = asyncio.ensure_future(call.read())
    await asyncio.wait_for(started.wait(), 10)
    call.cancel()
    await asyncio.wait_for(fake.exec_cancelled.wait(), 10)
    await asyncio.gather(reader, return_exceptions=True)


async def test_a_setup_that_outlives_its_timeout_fails_without_rerunning(
    cluster: Cluster, sqlite_url: str, fake: FakeCompute
) -> None:
    fake.create_gate = asyncio.Event()  # never released: setup hangs in CreateSandbox
    # Long enough for the journal's writes before CreateSandbox, on a busy machine too.
    service = await cluster.start(sqlite_url, compute=fake, setup_timeout_s=1.0)
    env = (await create_env(service.stub, config=setup_config(SETUP))).environment
    result = await asyncio.wait_for(ensure(service.stub, env.id), 10)
    assert result.status == FAILED and result.error.code == "setup_timeout"
    assert (await ensure(service.stub, env.id)).status == FAILED
    assert len(fake.created) == 1 and fake.setup_runs(SETUP) == 0
