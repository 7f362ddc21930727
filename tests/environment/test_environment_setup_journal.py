"""The setup journal on SQLite and PostgreSQL, with the in-memory compute:
a new owner continues from the first step not recorded as done, runs the
interrupted step again, reuses a live sandbox or replaces a stale one, and
an owner that lost its lease can write nothing more."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from alembic import command
from environment_fakes import ExecCall, FakeCompute
from db_support import migrations_of, service_database
from environment_helpers import Cluster, EnvService, create_env, ensure, get_env, reason_of, setup_config
from waiting import wait_until

from berth.environment.v1 import environment_pb2
from services.core.db import Database, _alembic_config, create_engine
from services.core.settings import normalize_database_url
from services.environment import repository as repo
from services.environment.init_guard import LeaseLost, SetupFence

READY = environment_pb2.ENVIRONMENT_STATUS_READY
FAILED = environment_pb2.ENVIRONMENT_STATUS_FAILED
PENDING = environment_pb2.ENVIRONMENT_STATUS_PENDING
INITIALIZING = environment_pb2.ENVIRONMENT_STATUS_INITIALIZING
MIGRATIONS = migrations_of("environment")
FIRST, GATED, LAST = "echo one >> steps", "echo two >> steps  # gated", "echo three >> steps"


class Gate:
    """An exec handler that blocks the first run of ``GATED`` until opened,
    and fails the commands named in ``failing``."""

    def __init__(self, *failing: str) -> None:
        self.reached = asyncio.Event()
        self.open = asyncio.Event()
        self.failing = set(failing)
        self.runs = 0

    async def __call__(self, call: ExecCall) -> int:
        if call.shell == GATED:
            self.runs += 1
            if self.runs == 1:
                self.reached.set()
                await self.open.wait()
        return 3 if call.shell in self.failing else 0


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    async with service_database(database_url, "environment") as database:
        yield database


async def journal(db: Database, environment_id: str) -> set[str]:
    return await db.run(lambda s: repo.done_steps(s, environment_id), read_only=True)


async def start_gated(cluster: Cluster, database_url: str, fake: FakeCompute, gate: Gate, **overrides: Any) -> tuple[EnvService, str, str]:
    """One service runs setup up to the gated second command and stays there."""
    fake.exec_handler = gate
    one = await cluster.start(database_url, compute=fake, **overrides)
    env = (await create_env(one.stub, config=setup_config(FIRST, GATED, LAST))).environment
    owner = asyncio.ensure_future(ensure(one.stub, env.id))
    await asyncio.wait_for(gate.reached.wait(), 10)
    assert not owner.done()
    owner.add_done_callback(lambda t: t.cancelled() or t.exception())
    return one, env.id, env.sandbox_id


async def test_a_new_owner_continues_from_the_first_step_not_done_and_reruns_the_interrupted_one(
    cluster: Cluster, database_url: str, fake: FakeCompute, db: Database
) -> None:
    gate = Gate()
    one, env_id, sandbox_id = await start_gated(cluster, database_url, fake, gate)
    assert await journal(db, env_id) == {"sandbox", "command:1"}
    two = await cluster.start(database_url, compute=fake)
    peer = asyncio.ensure_future(ensure(two.stub, env_id))
    await cluster.stop(one)

    result = await asyncio.wait_for(peer, 10)
    assert result.status == READY and result.sandbox_id == sandbox_id
    assert (fake.setup_runs(FIRST), fake.setup_runs(GATED), fake.setup_runs(LAST)) == (1, 2, 1)
    assert set(fake.created_ids) == {sandbox_id} and fake.destroyed == []
    assert await journal(db, env_id) == {"sandbox", "command:1", "command:2", "command:3"}


async def test_a_setup_nobody_waits_for_is_taken_over_by_the_sweep(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    gate = Gate()
    one, env_id, sandbox_id = await start_gated(cluster, database_url, fake, gate, init_lease_s=0.5)
    two = await cluster.start(database_url, compute=fake, init_lease_s=0.5)
    await cluster.stop(one)

    async def ready() -> bool:
        return (await get_env(two.stub, env_id)).status == READY

    await wait_until(ready, timeout=10, what="the sweep of the second service finished setup")
    assert (fake.setup_runs(FIRST), fake.setup_runs(GATED), fake.setup_runs(LAST)) == (1, 2, 1)
    assert set(fake.created_ids) == {sandbox_id}


async def test_a_step_that_fails_after_a_takeover_fails_the_environment_and_runs_nothing_after_it(
    cluster: Cluster, database_url: str, fake: FakeCompute, db: Database
) -> None:
    gate = Gate(GATED)
    one, env_id, _ = await start_gated(cluster, database_url, fake, gate)
    two = await cluster.start(database_url, compute=fake)
    peer = asyncio.ensure_future(ensure(two.stub, env_id))
    await cluster.stop(one)

    result = await asyncio.wait_for(peer, 10)
    assert result.status == FAILED and result.error.code == "setup_command_failed"
    assert fake.setup_runs(LAST) == 0
    assert await journal(db, env_id) == {"sandbox", "command:1"}
    assert (await ensure(two.stub, env_id)).status == FAILED
    assert fake.setup_runs(GATED) == 2


async def test_a_takeover_replaces_a_recorded_sandbox_that_is_gone_and_starts_over(
    cluster: Cluster, database_url: str, fake: FakeCompute
) -> None:
    gate = Gate()
    one, env_id, sandbox_id = await start_gated(cluster, database_url, fake, gate)
    fake.dead.add(sandbox_id)
    two = await cluster.start(database_url, compute=fake)
    peer = asyncio.ensure_future(ensure(two.stub, env_id))
    await cluster.stop(one)

    result = await asyncio.wait_for(peer, 10)
    assert result.status == READY
    assert result.sandbox_id != sandbox_id
    assert fake.destroyed == [sandbox_id]
    assert fake.created_ids[-1] == result.sandbox_id and fake.created_ids.count(result.sandbox_id) == 1
    # Every step ran again in the new sandbox.
    assert (fake.setup_runs(FIRST), fake.setup_runs(GATED), fake.setup_runs(LAST)) == (2, 2, 1)


async def test_an_unreachable_sandbox_service_mid_setup_defers_and_the_next_caller_resumes(
    cluster: Cluster, database_url: str, fake: FakeCompute, db: Database
) -> None:
    gate = Gate()
    one, env_id, sandbox_id = await start_gated(cluster, database_url, fake, gate)
    fake.unavailable = True
    gate.open.set()  # the gated command ends; the next one cannot start

    async def pending() -> bool:
        return (await get_env(one.stub, env_id)).status == PENDING

    await wait_until(pending, timeout=10, what="setup deferred back to pending")
    assert await journal(db, env_id) == {"sandbox", "command:1", "command:2"}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ensure(one.stub, env_id)
    assert reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    fake.unavailable = False
    assert (await ensure(one.stub, env_id)).status == READY
    assert (fake.setup_runs(FIRST), fake.setup_runs(GATED), fake.setup_runs(LAST)) == (1, 1, 1)
    assert set(fake.created_ids) == {sandbox_id}


async def test_an_owner_whose_lease_was_taken_over_cannot_write(
    cluster: Cluster, database_url: str, fake: FakeCompute, db: Database
) -> None:
    service = await cluster.start(database_url, compute=fake)
    env_id = (await create_env(service.stub, config=setup_config(FIRST))).environment.id
    now = time.time()
    assert await db.run(lambda s: repo.start_init(s, env_id, version=0, owner="old", lease_expires_at=now - 1, now=now))
    old = SetupFence(db, env_id, 1, "old")
    await old.record_step("sandbox", ())
    assert await db.run(lambda s: repo.take_over_init(s, env_id, version=1, owner="new", lease_expires_at=now + 60, now=now))
    new = SetupFence(db, env_id, 2, "new")

    with pytest.raises(LeaseLost):
        await old.record_step("command:1", ())
    with pytest.raises(LeaseLost):
        await old.mark_sandbox_requested("elsewhere")
    with pytest.raises(LeaseLost):
        await old.replace_sandbox("sbx_other")
    assert old.lost
    assert not await db.run(lambda s: repo.renew_lease(s, env_id, version=1, owner="old", lease_expires_at=now + 60))
    assert not await db.run(
        lambda s: repo.finish_init(
            s, env_id, version=1, owner="old", status="ready", error_code="", error_message="", now=now
        )
    )
    # A live lease is never taken over.
    assert not await db.run(lambda s: repo.take_over_init(s, env_id, version=2, owner="third", lease_expires_at=now + 60, now=now))
    await new.record_step("command:1", ())
    assert await journal(db, env_id) == {"sandbox", "command:1"}
    row = await get_env(service.stub, env_id)
    assert row.status == INITIALIZING


async def test_the_journal_migration_upgrades_and_downgrades(database_url: str) -> None:
    engine = create_engine(normalize_database_url(database_url))
    steps = [("upgrade", "environment_0003"), ("upgrade", "head"), ("downgrade", "environment_0003"), ("upgrade", "head")]

    def migrate(c: sa.Connection, move: str, target: str) -> None:
        config = _alembic_config("environment", MIGRATIONS, c)
        if move == "upgrade":
            command.upgrade(config, target)
        else:
            command.downgrade(config, target)

    try:
        for move, target in steps:
            async with engine.begin() as conn:
                await conn.run_sync(migrate, move, target)
                tables = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
            assert ("setup_steps" in tables) == (target == "head")
    finally:
        await engine.dispose()


async def test_empty_skill_and_plugin_lists_are_no_setup_steps(
    cluster: Cluster, database_url: str, fake: FakeCompute, db: Database
) -> None:
    service = await cluster.start(database_url, compute=fake)
    # The gateway sends "[]" for an environment without skills or plugins.
    empty = (await create_env(service.stub, config=setup_config(FIRST, skills_json="[]", plugins_json="[]"))).environment
    assert (await ensure(service.stub, empty.id)).status == READY
    assert await journal(db, empty.id) == {"sandbox", "command:1"}
