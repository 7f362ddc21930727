"""A service's PostgreSQL connections: a fixed set reused under load, one
that died while idle replaced before use, read-only units that run their
statements without a transaction around them, and a database that goes
away seen as unavailable (UNAVAILABLE, a 503) instead of an internal error."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy.exc
from db_support import terminate_backends
from hosts_support import free_port
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from services.core.db import Database, create_engine
from services.core.errors import DatabaseUnavailable
from services.core.settings import DatabasePool, normalize_database_url

pytestmark = pytest.mark.postgres


async def _backend_pid(db: Database) -> int:
    async with db.transaction(read_only=True) as s:
        pid = int((await s.execute(text("SELECT pg_backend_pid()"))).scalar_one())
        # Held a moment, so that concurrent transactions need connections of their own.
        await asyncio.sleep(0.01)
        return pid


async def test_a_busy_service_reuses_its_pooled_connections_instead_of_opening_one_per_transaction(
    fresh_postgres_database: str,
) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database), pool=DatabasePool(size=4)))
    try:
        pids: set[int] = set()
        # Three times the pool's size at once, ten rounds.
        for _ in range(10):
            pids.update(await asyncio.gather(*(_backend_pid(db) for _ in range(12))))
        assert len(pids) <= 4
    finally:
        await db.dispose()


async def test_a_pooled_connection_that_died_while_idle_is_replaced_before_the_next_transaction_uses_it(
    fresh_postgres_database: str,
) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database), pool=DatabasePool(size=2, ping_idle_s=0.2)))
    try:
        pid = await _backend_pid(db)
        # The server goes away under the idle connection (a restart, a failover).
        await terminate_backends(fresh_postgres_database, {pid})
        # Time must pass for this: the connection idles longer than ping_idle_s.
        await asyncio.sleep(0.3)
        # Idle past ping_idle_s: pinged at checkout, found dead, replaced.
        assert await _backend_pid(db) != pid
    finally:
        await db.dispose()


async def test_a_connection_in_steady_use_is_not_pinged_so_one_that_died_fails_once_and_the_pool_recovers(
    fresh_postgres_database: str,
) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database), pool=DatabasePool(size=2, ping_idle_s=60)))
    try:
        pid = await _backend_pid(db)
        await terminate_backends(fresh_postgres_database, {pid})
        # Returned a moment ago: handed out without a ping, so its first use fails ...
        with pytest.raises(DatabaseUnavailable) as failed:
            await _backend_pid(db)
        cause = failed.value.__cause__
        assert isinstance(cause, sqlalchemy.exc.DBAPIError) and cause.connection_invalidated
        # ... and that disconnect invalidated the pool: the next transaction gets a new connection.
        assert await _backend_pid(db) != pid
    finally:
        await db.dispose()


async def test_a_read_only_unit_runs_each_statement_on_its_own_without_begin_or_commit(fresh_postgres_database: str) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database)))
    try:
        async with db.transaction(read_only=True) as s:
            # now() is the start of the statement's transaction: one transaction would give one value.
            first = (await s.execute(text("SELECT now()"))).scalar_one()
            await asyncio.sleep(0.01)
            second = (await s.execute(text("SELECT now()"))).scalar_one()
        assert second > first
        async with db.transaction() as s:
            first = (await s.execute(text("SELECT now()"))).scalar_one()
            await asyncio.sleep(0.01)
            second = (await s.execute(text("SELECT now()"))).scalar_one()
        # A unit that may write is one transaction.
        assert second == first
    finally:
        await db.dispose()


async def _pid_of(s: AsyncSession) -> int:
    return int((await s.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def test_a_read_only_run_whose_connection_died_in_steady_use_is_tried_again_on_a_new_connection(
    fresh_postgres_database: str,
) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database), pool=DatabasePool(size=1, ping_idle_s=60)))
    try:
        pid = await db.run(_pid_of, read_only=True)
        await terminate_backends(fresh_postgres_database, {pid})
        attempts = 0

        async def counted(s: AsyncSession) -> int:
            nonlocal attempts
            attempts += 1
            return await _pid_of(s)

        # Its first attempt meets the dead connection; the second, a new one.
        assert await db.run(counted, read_only=True) != pid
        assert attempts == 2
    finally:
        await db.dispose()


async def test_a_writing_run_whose_connection_died_is_unavailable_and_is_not_run_again(fresh_postgres_database: str) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database), pool=DatabasePool(size=1, ping_idle_s=60)))
    try:
        async with db.transaction() as s:
            await s.execute(text("CREATE TABLE marks (n int)"))
        pid = await db.run(_pid_of)
        await terminate_backends(fresh_postgres_database, {pid})
        attempts = 0

        async def write(s: AsyncSession) -> None:
            nonlocal attempts
            attempts += 1
            await s.execute(text("INSERT INTO marks VALUES (1)"))

        # A write may have reached the server before the connection died: never run twice.
        with pytest.raises(DatabaseUnavailable):
            await db.run(write)
        assert attempts == 1
        async with db.transaction(read_only=True) as s:
            assert (await s.execute(text("SELECT count(*) FROM marks"))).scalar_one() == 0
    finally:
        await db.dispose()


async def test_a_server_that_refuses_connections_makes_a_unit_unavailable(fresh_postgres_database: str) -> None:
    closed = free_port()
    # Nothing listens on the port: the connect is refused.
    url = normalize_database_url(fresh_postgres_database).replace("127.0.0.1:5432", f"127.0.0.1:{closed}")
    assert str(closed) in url
    db = Database(create_engine(url))
    try:
        with pytest.raises(DatabaseUnavailable):
            await db.run(_pid_of, read_only=True)
    finally:
        await db.dispose()


async def test_a_query_the_server_rejects_is_not_mistaken_for_an_unavailable_database(fresh_postgres_database: str) -> None:
    db = Database(create_engine(normalize_database_url(fresh_postgres_database)))
    try:
        # The server's own error, as it was (an internal error for the caller).
        with pytest.raises(sqlalchemy.exc.ProgrammingError):
            async with db.transaction() as s:
                await s.execute(text("SELECT * FROM no_such_table"))
    finally:
        await db.dispose()
