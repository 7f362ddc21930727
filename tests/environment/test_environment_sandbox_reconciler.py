"""The sandbox reconciler against the real Sandbox service (bubblewrap) and
the Environment database on SQLite and PostgreSQL: sandboxes whose
environment no longer exists are destroyed, every other sandbox is kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from environment_helpers import Cluster, EnvService, SandboxService, create_env, ensure, md, run_command
from prometheus_client import REGISTRY
from grpc_support import credentials
from waiting import wait_until

from berth.environment.v1 import environment_pb2
from berth.sandbox.v1 import sandbox_pb2, sandbox_service_pb2 as sb
from services.core.db import Database, open_database
from services.core.settings import normalize_database_url
from services.environment import repository as repo
from services.environment.compute import SandboxClient, open_sandbox_channel
from services.environment.sandbox_nodes import SandboxNodes
from services.environment.sandbox_reconciler import (
    MASS_REAP_FLOOR,
    REASON_ENVIRONMENT_NOT_FOUND,
    REASON_ORGANIZATION_MISMATCH,
    ReapedSandbox,
    SandboxReconciler,
)

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "environment" / "migrations" / "versions"
READY = environment_pb2.ENVIRONMENT_STATUS_READY

MakeReconciler = Callable[..., Awaitable[SandboxReconciler]]


@pytest.fixture
async def environment_db(database_url: str) -> AsyncIterator[Database]:
    """A second handle on the Environment service's database, as another
    replica (or an operator) would have."""
    db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
    try:
        yield db
    finally:
        await db.dispose()


@pytest.fixture
async def make_reconciler(sandbox_service: SandboxService) -> AsyncIterator[MakeReconciler]:
    """Reconcilers, each with its own database handle and Sandbox service
    channel, as separate replicas have."""
    closers: list[Callable[[], Awaitable[None]]] = []

    async def make(
        database_url: str,
        *,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        nodes: dict[str, str] | None = None,
        max_fraction: float = 0.5,
    ) -> SandboxReconciler:
        """``nodes`` (name -> address) defaults to the one unnamed node."""
        db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
        closers.append(db.dispose)
        clients: dict[str, SandboxClient] = {}
        for name, address in (nodes or {"": sandbox_service.address}).items():
            channel = open_sandbox_channel(address, timeout_s=10, credentials=credentials("environment"))
            closers.append(channel.close)
            clients[name] = SandboxClient(channel, create_timeout_s=60, node=name)
        inventory = SandboxNodes(clients, placement_timeout_s=5)
        return SandboxReconciler(
            db, inventory, interval_s=3600, grace_s=grace_s, max_fraction=max_fraction, clock=clock
        )

    try:
        yield make
    finally:
        for close in reversed(closers):
            await close()


async def ready_environment(cluster: Cluster, database_url: str, sandbox_service: SandboxService) -> tuple[EnvService, str, str]:
    """(service, environment ID, sandbox ID) of a ready environment; the
    service runs no reconciler of its own."""
    service = await cluster.start(database_url, sandbox_addr=sandbox_service.address, environment_reconcile_interval_s=0)
    env = (await create_env(service.stub)).environment
    assert (await ensure(service.stub, env.id)).status == READY
    return service, env.id, env.sandbox_id


async def labelled_sandbox(sandbox_service: SandboxService, sandbox_id: str, environment_id: str, org: str = "org_a") -> None:
    """A sandbox created straight through the Sandbox service, labelled as an
    environment's sandbox would be."""
    request = sb.CreateSandboxRequest(sandbox_id=sandbox_id, labels={"berth.environment_id": environment_id})
    await sandbox_service.stub.CreateSandbox(request, metadata=md(org))


async def exists(sandbox_service: SandboxService, sandbox_id: str, org: str = "org_a") -> bool:
    try:
        response = await sandbox_service.stub.GetSandbox(sb.GetSandboxRequest(sandbox_id=sandbox_id), metadata=md(org))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise
    assert response.sandbox.state == sandbox_pb2.SANDBOX_STATE_RUNNING
    return True


async def test_a_sandbox_whose_environment_row_is_gone_is_destroyed_by_the_reconciler(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService, environment_db: Database, make_reconciler: MakeReconciler
) -> None:
    _, env_id, sandbox_id = await ready_environment(cluster, database_url, sandbox_service)
    # The row vanishes without the teardown that would destroy the sandbox
    # (say, a database restored from a backup older than the environment).
    async with environment_db.transaction() as s:
        await repo.delete_environment_rows(s, env_id)
    reconciler = await make_reconciler(database_url)
    reaped = await reconciler.reconcile()
    assert reaped == [ReapedSandbox(sandbox_id, env_id, "org_a", REASON_ENVIRONMENT_NOT_FOUND)]
    assert not await exists(sandbox_service, sandbox_id)
    assert await reconciler.reconcile() == []


async def test_a_pass_that_finds_most_sandboxes_orphaned_destroys_none_until_the_limit_is_lifted(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    # As if the service read an empty or wrong database: every labelled
    # sandbox names an environment it does not know.
    orphans = [f"sbx_mass_{i}" for i in range(MASS_REAP_FLOOR + 1)]
    for i, sandbox_id in enumerate(orphans):
        await labelled_sandbox(sandbox_service, sandbox_id, f"env_unknown_{i}")
    cautious = await make_reconciler(database_url)
    assert await cautious.reconcile() == []
    assert all([await exists(sandbox_service, sandbox_id) for sandbox_id in orphans])

    deliberate = await make_reconciler(database_url, max_fraction=1.0)
    reaped = await deliberate.reconcile()
    assert sorted(r.sandbox_id for r in reaped) == sorted(orphans)
    assert not any([await exists(sandbox_service, sandbox_id) for sandbox_id in orphans])


async def test_a_sandbox_whose_environment_is_ready_is_kept(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    service, env_id, sandbox_id = await ready_environment(cluster, database_url, sandbox_service)
    reconciler = await make_reconciler(database_url)
    assert await reconciler.reconcile() == []
    assert await exists(sandbox_service, sandbox_id)
    assert await run_command(service.stub, env_id, "echo still here") == (0, b"still here\n")


async def test_a_sandbox_whose_environment_is_being_deleted_is_left_to_its_teardown(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService, environment_db: Database, make_reconciler: MakeReconciler
) -> None:
    _, env_id, sandbox_id = await ready_environment(cluster, database_url, sandbox_service)
    async with environment_db.transaction() as s:
        assert await repo.mark_deleting(s, env_id, "org_a", require_unbound=True, require_never_shared=False)
    reconciler = await make_reconciler(database_url)
    assert await reconciler.reconcile() == []
    assert await exists(sandbox_service, sandbox_id)


async def test_a_sandbox_of_an_organization_without_any_environment_is_destroyed(
    sqlite_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    await labelled_sandbox(sandbox_service, "sbx_lonely", "env_gone", org="org_b")
    reconciler = await make_reconciler(sqlite_url)
    reaped = await reconciler.reconcile()
    assert reaped == [ReapedSandbox("sbx_lonely", "env_gone", "org_b", REASON_ENVIRONMENT_NOT_FOUND)]
    assert not await exists(sandbox_service, "sbx_lonely", org="org_b")


async def test_a_sandbox_labelled_with_another_organizations_environment_is_destroyed(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    _, env_id, sandbox_id = await ready_environment(cluster, sqlite_url, sandbox_service)
    await labelled_sandbox(sandbox_service, "sbx_impostor", env_id, org="org_b")
    reconciler = await make_reconciler(sqlite_url)
    reaped = await reconciler.reconcile()
    assert reaped == [ReapedSandbox("sbx_impostor", env_id, "org_b", REASON_ORGANIZATION_MISMATCH)]
    assert not await exists(sandbox_service, "sbx_impostor", org="org_b")
    assert await exists(sandbox_service, sandbox_id)


async def test_a_young_sandbox_is_kept_until_its_grace_period_ends(
    sqlite_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    await labelled_sandbox(sandbox_service, "sbx_young", "env_committing")
    offset = 0.0
    reconciler = await make_reconciler(sqlite_url, grace_s=600, clock=lambda: time.time() + offset)
    assert await reconciler.reconcile() == []
    assert await exists(sandbox_service, "sbx_young")
    offset = 601.0
    assert [r.sandbox_id for r in await reconciler.reconcile()] == ["sbx_young"]
    assert not await exists(sandbox_service, "sbx_young")


async def test_two_reconcilers_running_at_once_destroy_each_orphan_and_keep_the_rest(
    cluster: Cluster, database_url: str, sandbox_service: SandboxService, make_reconciler: MakeReconciler
) -> None:
    service, env_id, sandbox_id = await ready_environment(cluster, database_url, sandbox_service)
    orphans = [("sbx_orphan_1", "org_a"), ("sbx_orphan_2", "org_a"), ("sbx_orphan_3", "org_b")]
    for orphan, org in orphans:
        await labelled_sandbox(sandbox_service, orphan, f"env_gone_{orphan}", org=org)
    one = await make_reconciler(database_url)
    two = await make_reconciler(database_url)
    first, second = await asyncio.wait_for(asyncio.gather(one.reconcile(), two.reconcile()), 60)
    # Both decided alike, and destroying an orphan twice failed neither.
    assert sorted(r.sandbox_id for r in first) == sorted(r.sandbox_id for r in second) == [o for o, _ in orphans]
    for orphan, org in orphans:
        assert not await exists(sandbox_service, orphan, org=org)
    assert await exists(sandbox_service, sandbox_id)
    assert await run_command(service.stub, env_id, "true") == (0, b"")
    assert list(await asyncio.gather(one.reconcile(), two.reconcile())) == [[], []]


async def test_the_environment_service_reaps_orphans_when_it_starts(
    cluster: Cluster, sqlite_url: str, sandbox_service: SandboxService
) -> None:
    def reaped_count() -> float:
        value = REGISTRY.get_sample_value("berth_orphan_sandboxes_reaped_total", {"reason": REASON_ENVIRONMENT_NOT_FOUND})
        return value or 0.0

    await labelled_sandbox(sandbox_service, "sbx_left_behind", "env_gone")
    before = reaped_count()
    await cluster.start(
        sqlite_url,
        sandbox_addr=sandbox_service.address,
        environment_reconcile_interval_s=3600,
        environment_reconcile_grace_s=0,
    )

    async def destroyed() -> bool:
        return not await exists(sandbox_service, "sbx_left_behind")

    await wait_until(destroyed, timeout=30, what="the orphan is destroyed")
    assert reaped_count() == before + 1
