"""The Sandbox service's repository on SQLite and on PostgreSQL: state
changes are compare-and-set, and listings page in SQL with a keyset cursor."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import event

from services.core.db import Database, open_database
from services.core.settings import normalize_database_url
from services.sandbox import repository as repo
from services.sandbox.models import SandboxRow

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "sandbox" / "migrations" / "versions"
UNDESTROYED = ("creating", "running", "paused", "error")


@pytest.fixture
def _require_bwrap() -> None:
    """These tests touch only the database: no sandbox, so no bubblewrap."""


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """The Sandbox service's database, migrated, once on SQLite and once on
    PostgreSQL (an empty schema per test)."""
    if request.param == "sqlite":
        url = f"sqlite+berth:///{tmp_path / 'sandbox.db'}"
    else:
        import asyncpg

        url = request.getfixturevalue("postgres_database")
        conn = await asyncpg.connect(url, timeout=3)
        try:
            await conn.execute("DROP SCHEMA IF EXISTS public CASCADE; CREATE SCHEMA public;")
        finally:
            await conn.close()
    database = await open_database(normalize_database_url(url), "sandbox", MIGRATIONS)
    try:
        yield database
    finally:
        await database.dispose()


async def _add(
    db: Database, sandbox_id: str, *, org_id: str = "org_a", state: str = "running", labels: Mapping[str, str] | None = None
) -> None:
    async with db.transaction() as s:
        repo.insert_sandbox(
            s,
            SandboxRow(
                sandbox_id=sandbox_id,
                org_id=org_id,
                state=state,
                backend="local",
                isolation="bwrap",
                labels_json=json.dumps(dict(labels or {})),
                network_json="{}",
                env_json="{}",
                size=0,
                handle_json="{}",
                error="",
                created_at=1.0,
                last_active_at=1.0,
            ),
        )


async def _state(db: Database, sandbox_id: str) -> str:
    async with db.transaction(read_only=True) as s:
        row = await repo.get_sandbox(s, sandbox_id)
    assert row is not None
    return row.state


async def test_a_transition_from_the_expected_state_changes_the_row(db: Database) -> None:
    await _add(db, "sbx_a", state="creating")
    async with db.transaction() as s:
        await repo.transition(s, "sbx_a", ("creating",), "running", now=5.0, handle_json='{"kind": "local"}')
    async with db.transaction(read_only=True) as s:
        row = await repo.get_sandbox(s, "sbx_a")
    assert row is not None
    assert (row.state, row.last_active_at, row.handle_json) == ("running", 5.0, '{"kind": "local"}')


async def test_a_stale_transition_is_refused_as_a_failed_precondition_and_changes_nothing(db: Database) -> None:
    await _add(db, "sbx_a", state="running")
    # Both operations read "running"; the pause commits first.
    async with db.transaction() as s:
        await repo.transition(s, "sbx_a", ("running",), "paused", now=2.0)
    with pytest.raises(repo.IllegalTransition) as refused:
        async with db.transaction() as s:
            await repo.transition(s, "sbx_a", ("running",), "error", now=3.0, error="late")
    assert refused.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
    async with db.transaction(read_only=True) as s:
        row = await repo.get_sandbox(s, "sbx_a")
    assert row is not None
    assert (row.state, row.error, row.last_active_at) == ("paused", "", 2.0)


async def test_a_destroyed_sandbox_is_never_brought_back(db: Database) -> None:
    await _add(db, "sbx_a", state="running")
    async with db.transaction() as s:
        await repo.transition(s, "sbx_a", UNDESTROYED, "destroyed", now=2.0)
    with pytest.raises(repo.IllegalTransition):
        async with db.transaction() as s:
            await repo.transition(s, "sbx_a", UNDESTROYED, "running", now=3.0)
    assert await _state(db, "sbx_a") == "destroyed"


async def test_of_two_racing_transitions_from_one_state_exactly_one_wins(db: Database) -> None:
    await _add(db, "sbx_a", state="running")

    async def move(to: str) -> str:
        async with db.transaction() as s:
            await repo.transition(s, "sbx_a", ("running",), to, now=2.0)
        return to

    results = await asyncio.gather(move("paused"), move("destroyed"), return_exceptions=True)
    won = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, repo.IllegalTransition)]
    assert len(won) == 1 and len(refused) == 1
    assert await _state(db, "sbx_a") == won[0]


async def test_a_transition_of_an_unknown_sandbox_is_refused(db: Database) -> None:
    with pytest.raises(repo.IllegalTransition):
        async with db.transaction() as s:
            await repo.transition(s, "sbx_missing", UNDESTROYED, "error", now=1.0)


async def _all_pages(db: Database, page_size: int, fetch: Any) -> list[list[str]]:
    pages: list[list[str]] = []
    token = ""
    for _ in range(50):
        async with db.transaction(read_only=True) as s:
            page = await fetch(s, page_size=page_size, page_token=token)
        pages.append([row.sandbox_id for row in page.rows])
        token = page.next_page_token
        if not token:
            return pages
    raise AssertionError("the listing never reached its last page")


def _assert_complete_and_disjoint(pages: list[list[str]], expected: list[str], page_size: int) -> None:
    listed = [sandbox_id for page in pages for sandbox_id in page]
    assert listed == sorted(expected)
    assert len(set(listed)) == len(listed)
    assert all(0 < len(page) <= page_size for page in pages)
    assert len(pages) == -(-len(expected) // page_size)


async def test_a_label_key_is_matched_whole_in_the_query_before_paging(db: Database) -> None:
    matching = []
    for i in range(9):
        labels = {"berth.env": "x"} if i % 3 else {"team": "a"}
        await _add(db, f"sbx_{i}", labels=labels)
        if "berth.env" in labels:
            matching.append(f"sbx_{i}")
    # Keys are bound parameters, never JSON paths or prefixes.
    await _add(db, "sbx_path", labels={"berth": "x"})
    await _add(db, "sbx_prefix", labels={"berth.envy": "x"})
    await _add(db, "sbx_quote", labels={'we"ird': "1"})

    def fetch(s: Any, **paging: Any) -> Any:
        return repo.list_labeled_sandboxes(s, "berth.env", exclude_state="destroyed", **paging)

    for page_size in (1, 2, 4):
        _assert_complete_and_disjoint(await _all_pages(db, page_size, fetch), matching, page_size)

    def fetch_weird(s: Any, **paging: Any) -> Any:
        return repo.list_labeled_sandboxes(s, 'we"ird', exclude_state="destroyed", **paging)

    assert await _all_pages(db, 10, fetch_weird) == [["sbx_quote"]]


async def test_labeled_sandboxes_of_every_organization_are_listed_in_complete_disjoint_pages(db: Database) -> None:
    labeled = []
    for i in range(8):
        sandbox_id = f"sbx_{i}"
        if i % 2:
            await _add(db, sandbox_id, org_id=f"org_{i % 3}", labels={"berth.environment_id": f"env_{i}"})
            labeled.append(sandbox_id)
        else:
            await _add(db, sandbox_id, labels={"berth.environment": "not the key"})
    await _add(db, "sbx_gone", state="destroyed", labels={"berth.environment_id": "env_gone"})

    def fetch(s: Any, **paging: Any) -> Any:
        return repo.list_labeled_sandboxes(s, "berth.environment_id", exclude_state="destroyed", **paging)

    for page_size in (1, 3, 4, 50):
        _assert_complete_and_disjoint(await _all_pages(db, page_size, fetch), labeled, page_size)


async def test_a_page_cursor_stays_valid_when_the_previous_page_changes(db: Database) -> None:
    for i in range(6):
        await _add(db, f"sbx_{i}", labels={"k": "v"})
    async with db.transaction(read_only=True) as s:
        first = await repo.list_labeled_sandboxes(s, "k", exclude_state="destroyed", page_size=3, page_token="")
    async with db.transaction() as s:
        await repo.transition(s, "sbx_0", UNDESTROYED, "destroyed", now=2.0)
        await repo.transition(s, "sbx_2", UNDESTROYED, "destroyed", now=2.0)
    async with db.transaction(read_only=True) as s:
        second = await repo.list_labeled_sandboxes(
            s, "k", exclude_state="destroyed", page_size=3, page_token=first.next_page_token
        )
    assert [r.sandbox_id for r in first.rows] == ["sbx_0", "sbx_1", "sbx_2"]
    assert [r.sandbox_id for r in second.rows] == ["sbx_3", "sbx_4", "sbx_5"]
    assert second.next_page_token == ""


async def test_a_page_is_limited_in_sql_to_one_row_more_than_its_size(db: Database) -> None:
    for i in range(20):
        await _add(db, f"sbx_{i:02d}", labels={"k": "v"})
    queries: list[tuple[str, list[Any]]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if "FROM sandboxes" in statement:
            values = list(parameters.values()) if isinstance(parameters, dict) else list(parameters)
            queries.append((statement.upper(), values))

    event.listen(db.engine.sync_engine, "before_cursor_execute", record)
    try:
        async with db.transaction(read_only=True) as s:
            labeled = await repo.list_labeled_sandboxes(s, "k", exclude_state="destroyed", page_size=3, page_token="")
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", record)
    assert len(labeled.rows) == 3 and labeled.next_page_token == "sbx_02"
    assert len(queries) == 1
    for statement, values in queries:
        assert "LIMIT" in statement
        assert 4 in values
