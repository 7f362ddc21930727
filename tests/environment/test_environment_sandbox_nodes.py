"""Several Sandbox service nodes behind one Environment service: placement,
routing by the node each environment's row records, an unreachable node, and
the reconciler on every node. Real Sandbox services on bubblewrap, two nodes
in-process on their own data dirs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from alembic import command
from environment_helpers import (
    Cluster,
    EnvService,
    SandboxNodePool,
    create_env,
    ensure,
    get_env,
    md,
    reason_of,
    run_command,
)
from grpc_support import credentials
from waiting import wait_until

from berth.environment.v1 import environment_pb2, environment_service_pb2 as pb
from berth.sandbox.v1 import sandbox_service_pb2 as sb
from services.core.db import Database, _alembic_config, create_engine, open_database
from services.core.errors import SandboxUnavailable
from services.core.settings import normalize_database_url
from services.environment import repository as repo
from services.environment.compute import SandboxClient, open_sandbox_channel
from services.environment.models import EnvironmentRow
from services.environment.sandbox_nodes import SandboxNodes
from services.environment.sandbox_reconciler import (
    REASON_ENVIRONMENT_NOT_FOUND,
    REASON_NODE_MISMATCH,
    ReapedSandbox,
    SandboxReconciler,
)
from services.environment.states import EnvironmentStatus

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "environment" / "migrations" / "versions"
READY = environment_pb2.ENVIRONMENT_STATUS_READY
PENDING = environment_pb2.ENVIRONMENT_STATUS_PENDING
CLOSED_PORT = "127.0.0.1:1"


async def start(cluster: Cluster, database_url: str, nodes: list[str], **overrides: Any) -> EnvService:
    """An Environment service on these ``BERTH_SANDBOX_ADDRS`` entries, without a reconciler of its own."""
    overrides.setdefault("environment_reconcile_interval_s", 0)
    return await cluster.start(database_url, sandbox_addrs=nodes, **overrides)


async def ready_env(service: EnvService) -> environment_pb2.Environment:
    env = (await create_env(service.stub)).environment
    assert (await ensure(service.stub, env.id)).status == READY
    return env


async def recorded_node(database_url: str, environment_id: str) -> str:
    db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
    try:
        async with db.transaction(read_only=True) as s:
            row = await repo.get_environment_by_id(s, environment_id)
    finally:
        await db.dispose()
    assert row is not None
    return row.sandbox_node


async def labelled_sandbox(pool: SandboxNodePool, node: str, sandbox_id: str, environment_id: str, org: str = "org_a") -> None:
    request = sb.CreateSandboxRequest(sandbox_id=sandbox_id, labels={"berth.environment_id": environment_id})
    await pool.running[node].stub.CreateSandbox(request, metadata=md(org))


@dataclass
class Opened:
    """Node inventories and database handles a test opens, as another
    replica's would be; closed at teardown."""

    pool: SandboxNodePool
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def inventory(self, nodes: dict[str, str] | None = None) -> SandboxNodes:
        """Nodes by name -> address; by default the pool's a and b."""
        clients: dict[str, SandboxClient] = {}
        for name, address in (nodes or {n: self.pool.running[n].address for n in ("a", "b")}).items():
            channel = open_sandbox_channel(address, timeout_s=10, credentials=credentials("environment"))
            self.closers.append(channel.close)
            clients[name] = SandboxClient(channel, create_timeout_s=60, node=name)
        return SandboxNodes(clients, placement_timeout_s=5)

    async def database(self, database_url: str) -> Database:
        db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
        self.closers.append(db.dispose)
        return db


@pytest.fixture
async def opened(sandbox_nodes: SandboxNodePool) -> AsyncIterator[Opened]:
    handles = Opened(sandbox_nodes)
    try:
        yield handles
    finally:
        for close in reversed(handles.closers):
            await close()


# Placement and routing ---------------------------------------------------------


async def test_environments_are_spread_over_two_nodes_and_each_runs_its_commands_on_its_own_node(
    cluster: Cluster, database_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, database_url, sandbox_nodes.addrs("a", "b"))
    first = await ready_env(service)
    second = await ready_env(service)
    assert await recorded_node(database_url, first.id) == "a"
    assert await recorded_node(database_url, second.id) == "b"

    assert await run_command(service.stub, first.id, "echo first > where.txt") == (0, b"")
    assert await run_command(service.stub, second.id, "echo second > where.txt") == (0, b"")

    assert (sandbox_nodes.workspace("a", first.sandbox_id) / "where.txt").read_bytes() == b"first\n"
    assert (sandbox_nodes.workspace("b", second.sandbox_id) / "where.txt").read_bytes() == b"second\n"
    assert not sandbox_nodes.workspace("b", first.sandbox_id).exists()
    assert not sandbox_nodes.workspace("a", second.sandbox_id).exists()
    assert await sandbox_nodes.holds("a", first.sandbox_id) and not await sandbox_nodes.holds("b", first.sandbox_id)
    assert await sandbox_nodes.holds("b", second.sandbox_id) and not await sandbox_nodes.holds("a", second.sandbox_id)


async def test_a_second_replica_on_the_same_database_routes_to_the_recorded_node(
    cluster: Cluster, database_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    one = await start(cluster, database_url, sandbox_nodes.addrs("a", "b"))
    on_a = await ready_env(one)
    on_b = await ready_env(one)
    for env in (on_a, on_b):
        await one.stub.WriteWorkspaceFile(
            pb.WriteWorkspaceFileRequest(environment_id=env.id, path="/workspace/id.txt", data=env.id.encode()), metadata=md()
        )
    # The other replica lists the nodes the other way round: its default
    # node, and its first choice on a tie, is b.
    two = await start(cluster, database_url, sandbox_nodes.addrs("b", "a"))
    for env in (on_a, on_b):
        assert await run_command(two.stub, env.id, "cat id.txt") == (0, env.id.encode())
        listed = await two.stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=env.id), metadata=md())
        assert "/workspace/id.txt" in [e.path for e in listed.entries]


async def test_with_one_node_down_the_other_nodes_environments_keep_working(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    on_a = await ready_env(service)
    on_b = await ready_env(service)
    await sandbox_nodes.stop("b")

    assert await run_command(service.stub, on_a.id, "echo alive") == (0, b"alive\n")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(service.stub, on_b.id, "true")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert on_b.id in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await service.stub.ListWorkspaceFiles(pb.ListWorkspaceFilesRequest(environment_id=on_b.id), metadata=md())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert (await get_env(service.stub, on_b.id)).status == READY
    # New environments go to the node that answers.
    fresh = await ready_env(service)
    assert await run_command(service.stub, fresh.id, "true") == (0, b"")
    assert await sandbox_nodes.holds("a", fresh.sandbox_id)


async def test_placement_skips_an_unreachable_node_even_when_it_is_listed_first(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, [f"down={CLOSED_PORT}", *sandbox_nodes.addrs("b")])
    env = await ready_env(service)
    assert await recorded_node(sqlite_url, env.id) == "b"
    assert await run_command(service.stub, env.id, "echo ok > ok.txt") == (0, b"")
    assert (sandbox_nodes.workspace("b", env.sandbox_id) / "ok.txt").read_bytes() == b"ok\n"


async def test_no_reachable_node_defers_setup_and_keeps_the_environment_pending(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, [f"down={CLOSED_PORT}", "gone=127.0.0.1:2"])
    env = (await create_env(service.stub)).environment
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ensure(service.stub, env.id)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"
    assert (await get_env(service.stub, env.id)).status == PENDING
    await cluster.stop(service)
    back = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    assert (await ensure(back.stub, env.id)).status == READY


async def test_an_environment_on_a_node_that_is_no_longer_configured_is_unavailable(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    await ready_env(service)
    on_b = await ready_env(service)
    await cluster.stop(service)
    only_a = await start(cluster, sqlite_url, sandbox_nodes.addrs("a"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run_command(only_a.stub, on_b.id, "true")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "SANDBOX_UNAVAILABLE"


async def test_deleting_an_environment_destroys_its_sandbox_on_its_own_node(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    on_a = await ready_env(service)
    on_b = await ready_env(service)
    await service.stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=on_b.id), metadata=md())
    assert not await sandbox_nodes.holds("b", on_b.sandbox_id)
    assert await sandbox_nodes.holds("a", on_a.sandbox_id)


async def test_an_environment_created_with_the_single_unnamed_node_routes_to_the_first_listed_node(
    cluster: Cluster, database_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    single = await cluster.start(database_url, sandbox_addr=sandbox_nodes.running["a"].address, environment_reconcile_interval_s=0)
    env = await ready_env(single)
    assert await recorded_node(database_url, env.id) == ""
    await cluster.stop(single)
    several = await start(cluster, database_url, sandbox_nodes.addrs("a", "b"))
    assert await run_command(several.stub, env.id, "echo still > here.txt") == (0, b"")
    assert (sandbox_nodes.workspace("a", env.sandbox_id) / "here.txt").read_bytes() == b"still\n"


async def test_environments_from_before_the_node_column_record_the_default_node(database_url: str) -> None:
    engine = create_engine(normalize_database_url(database_url))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(_alembic_config("environment", MIGRATIONS, c), "environment_0002"))
            await conn.execute(
                sa.text(
                    "INSERT INTO environments (id, org_id, status, lifetime, ever_shared, deleting, sandbox_id, "
                    "sandbox_requested, config, vault_ids_json, owner_session_id, session_count, error_code, error_message, "
                    "init_version, lease_owner, lease_expires_at, create_time, update_time) VALUES ('env_old', 'org_a', "
                    "'ready', 'private', false, false, 'sbx_old', true, :config, '[]', '', 0, '', '', 2, '', 0, :now, :now)"
                ),
                {"config": b"", "now": time.time()},
            )
    finally:
        await engine.dispose()
    db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
    try:
        async with db.transaction(read_only=True) as s:
            row = await repo.get_environment_by_id(s, "env_old")
    finally:
        await db.dispose()
    assert row is not None and row.sandbox_node == "" and row.sandbox_id == "sbx_old"


async def test_a_retried_placement_keeps_the_node_recorded_before_while_it_answers(
    sandbox_nodes: SandboxNodePool, opened: Opened
) -> None:
    nodes = opened.inventory()
    assert await nodes.place_sandbox("b") == "b"
    assert await nodes.place_sandbox("") == "a"  # no name is the default node
    await sandbox_nodes.stop("b")
    assert await nodes.place_sandbox("b") == "a"


# The reconciler on every node ----------------------------------------------------


async def test_the_reconciler_reaps_orphans_on_every_node_and_keeps_each_environments_sandbox(
    cluster: Cluster, database_url: str, sandbox_nodes: SandboxNodePool, opened: Opened
) -> None:
    service = await start(cluster, database_url, sandbox_nodes.addrs("a", "b"))
    on_a = await ready_env(service)
    on_b = await ready_env(service)
    await labelled_sandbox(sandbox_nodes, "a", "sbx_orphan_a", "env_gone_a")
    await labelled_sandbox(sandbox_nodes, "b", "sbx_orphan_b", "env_gone_b", org="org_b")
    reconciler = SandboxReconciler(await opened.database(database_url), opened.inventory(), interval_s=3600, grace_s=0)
    reaped = await reconciler.reconcile()
    assert sorted(reaped, key=lambda r: r.node) == [
        ReapedSandbox("sbx_orphan_a", "env_gone_a", "org_a", REASON_ENVIRONMENT_NOT_FOUND, node="a"),
        ReapedSandbox("sbx_orphan_b", "env_gone_b", "org_b", REASON_ENVIRONMENT_NOT_FOUND, node="b"),
    ]
    assert not await sandbox_nodes.holds("a", "sbx_orphan_a")
    assert not await sandbox_nodes.holds("b", "sbx_orphan_b", org="org_b")
    assert await sandbox_nodes.holds("a", on_a.sandbox_id) and await sandbox_nodes.holds("b", on_b.sandbox_id)
    assert await reconciler.reconcile() == []


async def test_the_reconciler_reaps_on_the_nodes_that_answer_when_one_is_down(
    sqlite_url: str, sandbox_nodes: SandboxNodePool, opened: Opened
) -> None:
    await labelled_sandbox(sandbox_nodes, "b", "sbx_orphan_b", "env_gone")
    nodes = opened.inventory({"down": CLOSED_PORT, "b": sandbox_nodes.running["b"].address})
    reconciler = SandboxReconciler(await opened.database(sqlite_url), nodes, interval_s=3600, grace_s=0)
    assert [r.sandbox_id for r in await reconciler.reconcile()] == ["sbx_orphan_b"]
    await sandbox_nodes.stop("b")
    with pytest.raises(SandboxUnavailable):
        await reconciler.reconcile()


async def test_a_copy_on_another_node_than_the_recorded_one_is_reaped_once_the_recorded_node_holds_the_sandbox(
    cluster: Cluster, database_url: str, sandbox_nodes: SandboxNodePool, opened: Opened
) -> None:
    service = await start(cluster, database_url, sandbox_nodes.addrs("a", "b"))
    env = await ready_env(service)  # on a
    # What a setup deferred after CreateSandbox reached b, and then placed on a, leaves behind.
    await labelled_sandbox(sandbox_nodes, "b", env.sandbox_id, env.id)
    reconciler = SandboxReconciler(await opened.database(database_url), opened.inventory(), interval_s=3600, grace_s=0)
    assert await reconciler.reconcile() == [ReapedSandbox(env.sandbox_id, env.id, "org_a", REASON_NODE_MISMATCH, node="b")]
    assert not await sandbox_nodes.holds("b", env.sandbox_id)
    assert await run_command(service.stub, env.id, "echo kept") == (0, b"kept\n")


async def test_a_copy_on_another_node_is_kept_while_it_may_be_the_environments_only_sandbox(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool, opened: Opened
) -> None:
    single = await cluster.start(sqlite_url, sandbox_addr=sandbox_nodes.running["a"].address, environment_reconcile_interval_s=0)
    unnamed = await ready_env(single)  # no node recorded: the default node
    await labelled_sandbox(sandbox_nodes, "b", unnamed.sandbox_id, unnamed.id)
    service = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    lost = await ready_env(service)  # its sandbox then disappears from its node
    home = await recorded_node(sqlite_url, lost.id)
    elsewhere = {"a": "b", "b": "a"}[home]
    await sandbox_nodes.running[home].stub.DestroySandbox(sb.DestroySandboxRequest(sandbox_id=lost.sandbox_id), metadata=md())
    await labelled_sandbox(sandbox_nodes, elsewhere, lost.sandbox_id, lost.id)
    # Setup deferred after its sandbox was created on its node: a retry may
    # still be placed on the other node and reuse the copy there.
    deferred = await ready_env(service)
    deferred_home = await recorded_node(sqlite_url, deferred.id)
    deferred_elsewhere = {"a": "b", "b": "a"}[deferred_home]
    await labelled_sandbox(sandbox_nodes, deferred_elsewhere, deferred.sandbox_id, deferred.id)
    db = await opened.database(sqlite_url)
    async with db.transaction() as s:
        await s.execute(sa.update(EnvironmentRow).where(EnvironmentRow.id == deferred.id).values(status=EnvironmentStatus.PENDING))
    reconciler = SandboxReconciler(db, opened.inventory(), interval_s=3600, grace_s=0)
    assert await reconciler.reconcile() == []
    assert await sandbox_nodes.holds("b", unnamed.sandbox_id)
    assert await sandbox_nodes.holds(elsewhere, lost.sandbox_id)
    assert await sandbox_nodes.holds(deferred_elsewhere, deferred.sandbox_id)


async def test_the_environment_service_reaps_orphans_on_every_node_when_it_starts(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    await labelled_sandbox(sandbox_nodes, "a", "sbx_left_a", "env_gone_a")
    await labelled_sandbox(sandbox_nodes, "b", "sbx_left_b", "env_gone_b")
    await start(
        cluster,
        sqlite_url,
        sandbox_nodes.addrs("a", "b"),
        environment_reconcile_interval_s=3600,
        environment_reconcile_grace_s=0,
    )

    async def destroyed() -> bool:
        return not await sandbox_nodes.holds("a", "sbx_left_a") and not await sandbox_nodes.holds("b", "sbx_left_b")

    await wait_until(destroyed, timeout=30, what="the orphans on both nodes are destroyed")


async def test_environments_set_up_at_the_same_time_are_spread_over_the_nodes(
    cluster: Cluster, sqlite_url: str, sandbox_nodes: SandboxNodePool
) -> None:
    service = await start(cluster, sqlite_url, sandbox_nodes.addrs("a", "b"))
    envs = [(await create_env(service.stub)).environment for _ in range(4)]
    ready = await asyncio.wait_for(asyncio.gather(*(ensure(service.stub, env.id) for env in envs)), 60)
    assert {r.status for r in ready} == {READY}
    nodes = [await recorded_node(sqlite_url, env.id) for env in envs]
    assert sorted(nodes) == ["a", "a", "b", "b"]
