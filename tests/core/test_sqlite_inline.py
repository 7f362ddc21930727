"""Berth's inline SQLite driver: statements run on the event loop, and
waiting for a lock never blocks it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy.exc
from sqlalchemy import text

from services.core.db import Database, WalCheckpointer, create_engine
from services.core.errors import DatabaseUnavailable
from services.core.settings import normalize_database_url


async def _database(path: Path, *, timeout_s: float = 30.0) -> Database:
    db = Database(create_engine(normalize_database_url(f"sqlite:///{path}"), sqlite_lock_timeout_s=timeout_s))
    async with db.transaction() as s:
        await s.execute(text("CREATE TABLE IF NOT EXISTS counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)"))
        await s.execute(text("INSERT OR IGNORE INTO counter (id, n) VALUES (1, 0)"))
    return db


async def _count(db: Database) -> int:
    async with db.transaction(read_only=True) as s:
        return int((await s.execute(text("SELECT n FROM counter WHERE id = 1"))).scalar_one())


def test_sqlite_urls_use_the_inline_driver(tmp_path: Path) -> None:
    engine = create_engine(normalize_database_url(f"sqlite:///{tmp_path / 'a.db'}"))
    assert engine.dialect.driver == "berth"
    assert create_engine(f"sqlite+aiosqlite:///{tmp_path / 'b.db'}").dialect.driver == "aiosqlite"


async def test_a_writer_waits_for_another_processes_lock_while_the_event_loop_keeps_running(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    db = await _database(path)
    try:
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("UPDATE counter SET n = 100 WHERE id = 1")

        async def write() -> None:
            async with db.transaction() as s:
                await s.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))

        writer = asyncio.create_task(write())
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1
        # The loop ran all along and the writer is still waiting for the lock.
        assert ticks == 20
        assert not writer.done()
        holder.execute("COMMIT")
        holder.close()
        await asyncio.wait_for(writer, timeout=5)
        assert await _count(db) == 101
    finally:
        await db.dispose()


async def test_a_writer_is_told_the_database_is_unavailable_once_the_lock_timeout_passes(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    await (await _database(path)).dispose()
    db = await _database(path, timeout_s=0.2)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(DatabaseUnavailable) as failed:
            async with asyncio.timeout(5), db.transaction() as s:
                await s.execute(text("UPDATE counter SET n = n + 1 WHERE id = 1"))
        assert isinstance(failed.value.__cause__, sqlalchemy.exc.OperationalError)
        holder.execute("ROLLBACK")
        # Nothing was written, and the database is usable afterwards.
        assert await _count(db) == 0
    finally:
        holder.close()
        await db.dispose()


async def test_concurrent_writers_of_one_process_all_commit(tmp_path: Path) -> None:
    db = await _database(tmp_path / "db.sqlite")
    try:

        async def increment() -> None:
            async with db.transaction() as s:
                n = (await s.execute(text("SELECT n FROM counter WHERE id = 1"))).scalar_one()
                await asyncio.sleep(0)  # another task runs while this transaction is open
                await s.execute(text("UPDATE counter SET n = :n WHERE id = 1"), {"n": n + 1})

        await asyncio.wait_for(asyncio.gather(*(increment() for _ in range(50))), timeout=30)
        assert await _count(db) == 50
    finally:
        await db.dispose()


async def test_readers_are_not_blocked_by_an_open_write_transaction(tmp_path: Path) -> None:
    db = await _database(tmp_path / "db.sqlite")
    try:
        release = asyncio.Event()

        async def slow_write() -> None:
            async with db.transaction() as s:
                await s.execute(text("UPDATE counter SET n = 7 WHERE id = 1"))
                await release.wait()

        writer = asyncio.create_task(slow_write())
        await asyncio.sleep(0.01)
        # The committed value, read while the writer holds the lock.
        assert await asyncio.wait_for(_count(db), timeout=2) == 0
        release.set()
        await asyncio.wait_for(writer, timeout=5)
        assert await _count(db) == 7
    finally:
        await db.dispose()


async def test_a_failed_statement_rolls_back_the_transaction(tmp_path: Path) -> None:
    db = await _database(tmp_path / "db.sqlite")
    try:
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            async with db.transaction() as s:
                await s.execute(text("UPDATE counter SET n = 5 WHERE id = 1"))
                await s.execute(text("INSERT INTO counter (id, n) VALUES (1, 0)"))
        assert await _count(db) == 0
        # The write lock was released: the next writer proceeds.
        async with asyncio.timeout(2), db.transaction() as s:
            await s.execute(text("UPDATE counter SET n = 3 WHERE id = 1"))
        assert await _count(db) == 3
    finally:
        await db.dispose()


async def test_commits_leave_the_wal_to_the_checkpointer_which_copies_it_into_the_database_off_the_event_loop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "db.sqlite"
    db = await _database(path)
    try:
        async with db.transaction() as s:
            # A commit that fills the WAL never checkpoints on the loop's thread.
            assert (await s.execute(text("PRAGMA wal_autocheckpoint"))).scalar_one() == 0
            await s.execute(text("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB NOT NULL)"))
        before = path.stat().st_size
        # About 2,500 pages of WAL: past the thousand at which a commit would checkpoint itself.
        for _ in range(100):
            async with db.transaction() as s:
                await s.execute(text("INSERT INTO blobs (data) VALUES (randomblob(100000))"))
        async with asyncio.timeout(10):
            while path.stat().st_size < before + 100 * 100_000:
                await asyncio.sleep(0.05)
        async with db.transaction(read_only=True) as s:
            assert (await s.execute(text("SELECT count(*) FROM blobs"))).scalar_one() == 100
    finally:
        await db.dispose()


def _checkpointers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "wal-checkpoint")


async def test_disposing_a_database_stops_its_checkpointer(tmp_path: Path) -> None:
    running = _checkpointers()
    db = await _database(tmp_path / "db.sqlite")
    assert _checkpointers() == running + 1
    await db.dispose()
    assert _checkpointers() == running


def test_a_checkpointer_that_cannot_open_its_database_yet_keeps_trying_and_checkpoints_once_it_can(tmp_path: Path) -> None:
    path = tmp_path / "later" / "db.sqlite"
    running = _checkpointers()
    checkpointer = WalCheckpointer(str(path), interval_s=0.02)
    checkpointer.start()
    try:
        # Its directory is missing: every connect fails, and the thread goes on.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert _checkpointers() == running + 1
            time.sleep(0.02)
        path.parent.mkdir()
        writer = sqlite3.connect(path, isolation_level=None)
        try:
            writer.execute("PRAGMA journal_mode=WAL")
            writer.execute("PRAGMA wal_autocheckpoint=0")
            writer.execute("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB NOT NULL)")
            before = path.stat().st_size
            for _ in range(20):
                writer.execute("INSERT INTO blobs (data) VALUES (randomblob(100000))")
            # Only a checkpoint copies the log into the database file.
            deadline = time.monotonic() + 10
            while path.stat().st_size < before + 20 * 100_000:
                assert time.monotonic() < deadline, "the WAL was never checkpointed"
                time.sleep(0.02)
        finally:
            writer.close()
    finally:
        checkpointer.stop()
