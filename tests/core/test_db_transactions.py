"""Transactions of every service are shielded from their caller's
cancellation (services/core/db.py): an ending that has begun runs to its end,
so no transaction is left half done or holding its connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.util.concurrency import await_

from services.core.db import Database, create_engine
from services.core.settings import normalize_database_url


@pytest.fixture(params=["sqlite", "postgresql"])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    else:
        url = request.getfixturevalue("postgres_database")
    database = Database(create_engine(normalize_database_url(url)))
    async with database.transaction() as s:
        await s.execute(text("DROP TABLE IF EXISTS shield_items"))
        await s.execute(text("CREATE TABLE shield_items (id INTEGER PRIMARY KEY)"))
    try:
        yield database
    finally:
        await database.dispose()


async def _ids(db: Database) -> list[int]:
    async with db.transaction(read_only=True) as s:
        return [int(v) for v in (await s.execute(text("SELECT id FROM shield_items ORDER BY id"))).scalars()]


async def _insert_two(s: AsyncSession) -> None:
    await s.execute(text("INSERT INTO shield_items (id) VALUES (1)"))
    await s.execute(text("INSERT INTO shield_items (id) VALUES (2)"))


def _cancel_during_commit(db: Database, caller: asyncio.Task[Any], committing: asyncio.Event) -> None:
    """Cancels ``caller`` once its commit has begun, and keeps the commit
    waiting on the event loop for a moment so the cancellation lands inside it."""

    @event.listens_for(db.engine.sync_engine, "commit")
    def _on_commit(_conn: Any) -> None:
        if committing.is_set():
            return
        committing.set()
        caller.cancel()
        await_(asyncio.sleep(0.05))


async def _settled(db: Database) -> None:
    """Waits (bounded) until every connection is back in the pool."""
    async with asyncio.timeout(5):
        while db.engine.pool.checkedout():  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)


async def test_a_transaction_whose_caller_is_cancelled_mid_commit_commits_all_its_rows(db: Database) -> None:
    committing = asyncio.Event()

    async def write() -> None:
        async with db.transaction() as s:
            await _insert_two(s)

    caller = asyncio.create_task(write())
    _cancel_during_commit(db, caller, committing)
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert committing.is_set()
    await _settled(db)
    assert await _ids(db) == [1, 2]
    # Nothing is left locked: the next writer goes through at once.
    async with asyncio.timeout(5), db.transaction() as s:
        await s.execute(text("INSERT INTO shield_items (id) VALUES (3)"))
    assert await _ids(db) == [1, 2, 3]


async def test_a_transaction_whose_caller_is_cancelled_before_commit_rolls_back_every_row(db: Database) -> None:
    inserted = asyncio.Event()

    async def write() -> None:
        async with db.transaction() as s:
            await s.execute(text("INSERT INTO shield_items (id) VALUES (1)"))
            inserted.set()
            await asyncio.Event().wait()

    caller = asyncio.create_task(write())
    async with asyncio.timeout(5):
        await inserted.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await _settled(db)
    assert await _ids(db) == []
    async with asyncio.timeout(5), db.transaction() as s:
        await s.execute(text("INSERT INTO shield_items (id) VALUES (1)"))
    assert await _ids(db) == [1]


async def test_a_unit_of_work_whose_caller_is_cancelled_runs_to_its_end_and_commits(db: Database) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    inflight: set[asyncio.Future[Any]] = set()
    seen: list[None] = []

    async def work(s: AsyncSession) -> None:
        await s.execute(text("INSERT INTO shield_items (id) VALUES (1)"))
        started.set()
        await release.wait()
        await s.execute(text("INSERT INTO shield_items (id) VALUES (2)"))

    caller = asyncio.create_task(db.run(work, inflight=inflight, after_commit=seen.append))
    async with asyncio.timeout(5):
        await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(inflight) == 1
    release.set()
    async with asyncio.timeout(5):
        await asyncio.wait(set(inflight))
    assert seen == [None]
    await _settled(db)
    assert await _ids(db) == [1, 2]
